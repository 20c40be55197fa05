"""Copiers that move chunk payloads between device and host memory.

An engine's worker converts its paged KV cache to a chunk's canonical tensors.
For vLLM, :mod:`chunkstore.vllm.layouts` does that. This module decides where
those tensors live and how their bytes reach host memory.

* :class:`HostCopier` serves a KV cache on the CPU. Its canonical tensors are
  views into the host chunk buffers. The layout conversion is the only copy.
  Every transfer is complete when the ``with`` block ends.
* :class:`ImageCopier` serves any other torch device. Its canonical tensors
  live in a device *image*: the rank's byte ranges of each chunk, packed.
  Each contiguous run is one copy between image and host buffer. At TP=1 a
  chunk is one run. The copies block. Devices without their own copier get
  this one.
* :class:`CudaCopier` uses the same images. Its kernels and copies run on a
  side stream. On saves, the side stream waits for the forward pass. It then
  gathers the blocks into the image. The compute stream waits only for that
  gather before it may overwrite the blocks. The copy to host overlaps the
  next forward pass. On loads, the copy to device and the scatter run on the
  side stream. The compute stream waits on an event; the CPU does not stall.
  The host pool pins its buffers with ``cudaHostRegister``. Pinned buffers
  are copied directly with ``non_blocking=True``. Other buffers go through a
  pinned staging buffer. The worker polls completion with :meth:`Fence.poll`.

:func:`select_copier` picks a copier from the KV cache's device. All CUDA calls
go through :class:`CudaRuntime`. Tests replace it to run :class:`CudaCopier`
on CPU tensors.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkstore.errors import ConfigError
from chunkstore.format import ChunkLayout

log = logging.getLogger(__name__)


# --- where a rank's tensors are ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardTensor:
    """The part of one canonical tensor a TP rank reads or writes."""

    name: str
    """Tensor name in the chunk, such as ``layers.3.k``."""
    payload_offset: int
    """Byte offset of the rank's part inside the chunk payload."""
    image_offset: int
    """Byte offset of the same bytes inside the packed device image."""
    nbytes: int
    """Size in bytes."""
    shape: tuple[int, ...]
    """Shape of the rank's part."""


@dataclass(frozen=True, slots=True)
class ShardMap:
    """Where a rank's tensors lie in a chunk payload and in a packed image.

    The packed image holds only the rank's bytes. ``runs`` lists the
    contiguous pieces a transfer copies. At TP=1 the one run is the whole
    payload. At TP>1 each layer has two runs: its K heads and its V heads.
    """

    tensors: tuple[ShardTensor, ...]
    """The rank's tensors, in payload order."""
    runs: tuple[tuple[int, int, int], ...]
    """Contiguous pieces as ``(payload_offset, image_offset, length)``."""
    image_size: int
    """Bytes of a packed image: the sum of the rank's parts."""
    payload_size: int
    """Bytes of a whole chunk payload."""

    @classmethod
    def build(cls, layout: ChunkLayout, rank: int, tp: int, *, for_write: bool) -> ShardMap:
        """The map of tensors that rank ``rank`` of ``tp`` reads or writes.

        ``for_write`` selects the tensors the rank writes. Writers skip
        replicated heads they do not own. Only rank 0 writes unsplit tensors,
        such as MLA latents. :meth:`ChunkLayout.rank_ranges` follows the same
        rules.
        """
        tensors: list[ShardTensor] = []
        runs: list[tuple[int, int, int]] = []
        image = 0
        for part in layout.rank_slices(rank, tp, for_write=for_write):
            offset, nbytes = part.offset, part.nbytes
            tensors.append(ShardTensor(part.name, offset, image, nbytes, part.shape))
            if runs and runs[-1][0] + runs[-1][2] == offset and runs[-1][1] + runs[-1][2] == image:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + nbytes)
            else:
                runs.append((offset, image, nbytes))
            image += nbytes
        return cls(tuple(tensors), tuple(runs), image, layout.payload_size)

    def views(
        self, flat: torch.Tensor, dtype: torch.dtype, *, image: bool
    ) -> dict[str, torch.Tensor]:
        """Typed views of every tensor in ``flat``, a uint8 image or payload."""
        out = {}
        for t in self.tensors:
            start = t.image_offset if image else t.payload_offset
            out[t.name] = flat[start : start + t.nbytes].view(dtype).view(t.shape)
        return out


# --- completion ------------------------------------------------------------------------------


class Fence:
    """Completion of one batch of copies.

    Call :meth:`poll` until it returns true, or call :meth:`wait`.
    """

    def poll(self) -> bool:
        """Whether the copies and any host-side finishing step are complete."""
        raise NotImplementedError

    def wait(self) -> None:
        """Block until complete."""
        raise NotImplementedError

    @property
    def seconds(self) -> float | None:
        """Seconds the copies took, or None until they complete.

        The time is device time when the device measured it.
        """
        raise NotImplementedError


class DoneFence(Fence):
    """Copies that completed before the fence was made."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def poll(self) -> bool:
        return True

    def wait(self) -> None:
        return

    @property
    def seconds(self) -> float | None:
        return self._seconds


class EventFence(Fence):
    """Copies that complete with a device event.

    The fence holds the copies' buffers until the event completes. Then
    ``finish`` runs once on the host. Saves into unpinned memory use it to
    copy the staging buffer into the host chunk buffer.
    """

    def __init__(
        self,
        done: Any,
        start: Any | None,
        keep: Sequence[Any],
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._done = done
        self._start = start
        self._keep: list[Any] | None = list(keep)
        self._finish = finish
        self._seconds: float | None = None

    def _complete(self) -> None:
        if self._keep is None:
            return
        if self._finish is not None:
            self._finish()
        if self._start is not None:
            self._seconds = float(self._start.elapsed_time(self._done)) / 1000.0
        self._keep = None  # the device and staging buffers may be reused now

    def poll(self) -> bool:
        if self._keep is None:
            return True
        if not self._done.query():
            return False
        self._complete()
        return True

    def wait(self) -> None:
        if self._keep is not None:
            self._done.synchronize()
            self._complete()

    @property
    def seconds(self) -> float | None:
        return self._seconds


@dataclass
class Batch:
    """One step's chunks on their way between host buffers and the device."""

    views: list[dict[str, torch.Tensor]]
    """Per chunk, a map from tensor name to the rank's part on the device."""
    nbytes: int
    """Bytes moved between device and host by this batch."""
    fence: Fence | None = None
    """Set when the ``with`` block ends: completion of the copies."""
    keep: list[Any] = field(default_factory=list)
    """Buffers the copies read or write; the fence holds them until complete."""
    start: Any = None
    """Device event recorded before the copies, or None."""


# --- copiers ------------------------------------------------------------------------------


def byte_tensor(buffer: Any) -> torch.Tensor:
    """A uint8 tensor over a host buffer, without a copy.

    A read-only buffer is fine for loads.
    """
    with warnings.catch_warnings():
        # Host chunks are read-only bytes on loads; torch only warns about it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


class DeviceCopier:
    """Moves chunk payloads between host buffers and a device.

    :meth:`saving` and :meth:`loading` are context managers. Run the layout
    conversion inside the block; it then runs on the copier's stream. Read
    ``batch.fence`` after the block.
    """

    name = "abstract"
    device: torch.device

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """A long tensor of block or token indices on the device, without a host sync."""
        return torch.tensor(list(values), dtype=torch.long).to(self.device)

    def saving(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype
    ) -> contextlib.AbstractContextManager[Batch]:
        """Yield device tensors to fill; copy them into ``payloads`` after the block.

        Each payload is a writable host buffer of ``shard.payload_size`` bytes.
        It is the payload part of a chunk buffer. The caller keeps the buffers
        alive until the fence completes.
        """
        raise NotImplementedError

    def loading(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype, *, block_compute: bool
    ) -> contextlib.AbstractContextManager[Batch]:
        """Yield device tensors that hold each chunk's rank part from ``payloads``.

        With ``block_compute``, the next forward pass waits for this work.
        Without it, the caller keeps the engine off the blocks until
        ``batch.fence`` completes.
        """
        raise NotImplementedError

    def settle(self) -> None:
        """Wait for device work that no fence covers, such as a failed batch's.

        Host and image copiers finish every copy before they return. For them
        this does nothing.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class HostCopier(DeviceCopier):
    """Copier for a KV cache in host memory.

    Its canonical tensors are views of the chunk buffers.
    """

    name = "host"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    @contextlib.contextmanager
    def saving(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype
    ) -> Iterator[Batch]:
        t0 = time.perf_counter()
        batch = Batch(
            [shard.views(byte_tensor(p), dtype, image=False) for p in payloads],
            shard.image_size * len(payloads),
        )
        yield batch
        batch.fence = DoneFence(time.perf_counter() - t0)

    @contextlib.contextmanager
    def loading(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype, *, block_compute: bool
    ) -> Iterator[Batch]:
        t0 = time.perf_counter()
        batch = Batch(
            [shard.views(byte_tensor(p), dtype, image=False) for p in payloads],
            shard.image_size * len(payloads),
        )
        yield batch
        batch.fence = DoneFence(time.perf_counter() - t0)


class ImageCopier(DeviceCopier):
    """Copier for any torch device, with blocking copies through device images."""

    name = "image"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    # Hooks the CUDA copier overrides; here: no streams, copies complete on return.

    def _on_side(self) -> contextlib.AbstractContextManager[Any]:
        """Context for conversion and copies; yields the compute stream or None."""
        return contextlib.nullcontext()

    def _empty_image(self, n: int, size: int) -> torch.Tensor:
        return torch.empty((n, size), dtype=torch.uint8, device=self.device)

    def _to_host(
        self,
        batch: Batch,
        image: torch.Tensor,
        hosts: list[torch.Tensor],
        shard: ShardMap,
        t0: float,
        compute: Any,
    ) -> Fence:
        for j, host in enumerate(hosts):
            for payload_off, image_off, length in shard.runs:
                host[payload_off : payload_off + length].copy_(
                    image[j, image_off : image_off + length]
                )
        return DoneFence(time.perf_counter() - t0)

    def _to_device(
        self, batch: Batch, image: torch.Tensor, hosts: list[torch.Tensor], shard: ShardMap
    ) -> None:
        for j, host in enumerate(hosts):
            for payload_off, image_off, length in shard.runs:
                image[j, image_off : image_off + length].copy_(
                    host[payload_off : payload_off + length]
                )

    def _loaded(self, batch: Batch, block_compute: bool, t0: float, compute: Any) -> Fence:
        return DoneFence(time.perf_counter() - t0)

    @contextlib.contextmanager
    def saving(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype
    ) -> Iterator[Batch]:
        t0 = time.perf_counter()
        hosts = [byte_tensor(p) for p in payloads]
        with self._on_side() as compute:
            image = self._empty_image(len(hosts), shard.image_size)
            batch = Batch(
                [shard.views(image[j], dtype, image=True) for j in range(len(hosts))],
                shard.image_size * len(hosts),
                keep=[image, *hosts],
            )
            yield batch
            batch.fence = self._to_host(batch, image, hosts, shard, t0, compute)

    @contextlib.contextmanager
    def loading(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype, *, block_compute: bool
    ) -> Iterator[Batch]:
        t0 = time.perf_counter()
        hosts = [byte_tensor(p) for p in payloads]
        with self._on_side() as compute:
            image = self._empty_image(len(hosts), shard.image_size)
            batch = Batch(
                [shard.views(image[j], dtype, image=True) for j in range(len(hosts))],
                shard.image_size * len(hosts),
                keep=[image, *hosts],
            )
            self._to_device(batch, image, hosts, shard)
            yield batch
            batch.fence = self._loaded(batch, block_compute, t0, compute)


class CudaRuntime:
    """The torch.cuda calls that :class:`CudaCopier` makes.

    Tests substitute a stand-in.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        # torch.cuda.Stream/Event have untyped constructors in torch's stubs.
        return torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]

    def is_pinned(self, host: torch.Tensor) -> bool:
        # True for cudaHostRegister'ed memory too (CUDA reports it as host-pinned).
        return bool(host.is_pinned())

    def pinned_empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, pin_memory=True)

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory()


class CudaCopier(ImageCopier):
    """Copier for CUDA, with a side stream and ``non_blocking`` copies.

    The worker polls an event for each batch.
    """

    name = "cuda"

    def __init__(
        self, device: torch.device | str, runtime: CudaRuntime | None = None, *, timing: bool = True
    ) -> None:
        super().__init__(device)
        self.runtime = runtime or CudaRuntime(self.device)
        self.stream = self.runtime.new_stream()
        """The side stream all conversion kernels and copies run on."""
        self.timing = timing
        self.staged_batches = 0
        """Number of batches copied through a pinned staging buffer."""
        self._warned_unpinned = False

    def index(self, values: Sequence[int]) -> torch.Tensor:
        # A copy from pageable memory would synchronise the stream and wait for the forward
        # pass. A copy from pinned memory is queued like any other.
        host = self.runtime.pin(torch.tensor(list(values), dtype=torch.long))
        return host.to(self.device, non_blocking=True)

    def settle(self) -> None:
        self.stream.synchronize()  # everything runs on the side stream

    @contextlib.contextmanager
    def _on_side(self) -> Iterator[Any]:
        compute = self.runtime.current_stream()
        # After the forward pass that wrote (saves) or the block zeroing that precedes (loads).
        self.stream.wait_stream(compute)
        with self.runtime.use_stream(self.stream):
            yield compute

    def _start_event(self) -> Any | None:
        if not self.timing:
            return None
        start = self.runtime.new_event(timing=True)
        start.record(self.stream)
        return start

    def _pinned(self, hosts: list[torch.Tensor]) -> bool:
        pinned = all(self.runtime.is_pinned(h) for h in hosts)
        if not pinned and not self._warned_unpinned:
            self._warned_unpinned = True
            log.info(
                "chunkstore: host chunk buffers are not pinned; copies go through a pinned "
                "staging buffer (one extra host copy)"
            )
        return pinned

    def _to_host(
        self,
        batch: Batch,
        image: torch.Tensor,
        hosts: list[torch.Tensor],
        shard: ShardMap,
        t0: float,
        compute: Any,
    ) -> Fence:
        gathered = self.runtime.new_event()
        gathered.record(self.stream)
        # The next kernels of the forward pass may reuse freed blocks: they wait for the
        # gather only (device to device), not for the copy to host below.
        compute.wait_event(gathered)
        start = self._start_event()
        finish: Callable[[], None] | None = None
        if self._pinned(hosts):
            for j, host in enumerate(hosts):
                for payload_off, image_off, length in shard.runs:
                    host[payload_off : payload_off + length].copy_(
                        image[j, image_off : image_off + length], non_blocking=True
                    )
        else:
            self.staged_batches += 1
            staging = self.runtime.pinned_empty(tuple(image.shape))
            staging.copy_(image, non_blocking=True)
            batch.keep.append(staging)

            def finish() -> None:
                for j, host in enumerate(hosts):
                    for payload_off, image_off, length in shard.runs:
                        host[payload_off : payload_off + length].copy_(
                            staging[j, image_off : image_off + length]
                        )

        done = self.runtime.new_event(timing=self.timing)
        done.record(self.stream)
        return EventFence(done, start, batch.keep, finish)

    def _to_device(
        self, batch: Batch, image: torch.Tensor, hosts: list[torch.Tensor], shard: ShardMap
    ) -> None:
        batch.start = self._start_event()
        if self._pinned(hosts):
            for j, host in enumerate(hosts):
                for payload_off, image_off, length in shard.runs:
                    image[j, image_off : image_off + length].copy_(
                        host[payload_off : payload_off + length], non_blocking=True
                    )
            return
        self.staged_batches += 1
        staging = self.runtime.pinned_empty(tuple(image.shape))
        for j, host in enumerate(hosts):
            for payload_off, image_off, length in shard.runs:
                staging[j, image_off : image_off + length].copy_(
                    host[payload_off : payload_off + length]
                )
        image.copy_(staging, non_blocking=True)
        batch.keep.append(staging)

    def _loaded(self, batch: Batch, block_compute: bool, t0: float, compute: Any) -> Fence:
        done = self.runtime.new_event(timing=self.timing)
        done.record(self.stream)
        if block_compute:
            # The forward pass reads these blocks: it waits on the device, the CPU does not.
            compute.wait_event(done)
        return EventFence(done, batch.start, batch.keep)


def select_copier(device: torch.device | str, runtime: CudaRuntime | None = None) -> DeviceCopier:
    """The copier for a KV cache on ``device``.

    CPU gets a :class:`HostCopier` and CUDA a :class:`CudaCopier`. Other
    devices, such as XPU and HPU, get an :class:`ImageCopier`. Tests pass
    ``runtime`` to replace the torch.cuda calls. Without ``runtime``, a CUDA
    device that torch cannot see raises :class:`~chunkstore.errors.ConfigError`.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return HostCopier(device)
    if device.type == "cuda":
        if runtime is None and not torch.cuda.is_available():
            raise ConfigError(f"KV cache is on {device}, but torch sees no CUDA device")
        return CudaCopier(device, runtime)
    log.info(
        "chunkstore: no asynchronous copier for %s devices; using blocking copies", device.type
    )
    return ImageCopier(device)
