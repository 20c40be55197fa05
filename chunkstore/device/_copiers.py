"""Device <-> host copies of chunk payloads: plain copies on CPU, a side stream on CUDA.

An engine's worker converts between its paged KV cache and a chunk's canonical
tensors; for vLLM, :mod:`chunkstore.vllm.layouts` does. This module only decides
*where* those canonical tensors live, and how their bytes reach host memory.

* :class:`HostCopier` is for a KV cache on the CPU. The canonical tensors are
  views straight into the host chunk buffers. So the layout conversion is the
  only copy, and every transfer is complete when the ``with`` block ends.
* :class:`ImageCopier` is for any other torch device. The canonical tensors
  live in a device *image*: the rank's byte ranges of each chunk, packed. The
  bytes move between the image and the host buffers with one copy per
  contiguous run. At TP=1 that is one per chunk. The copies block. This is the
  fallback for devices without a specialised copier.
* :class:`CudaCopier` uses the same images. But conversion kernels and copies
  run on a dedicated side stream. On saves, the side stream waits for the
  forward pass and gathers into the image. The compute stream then waits only
  for that device-to-device gather before its next kernels may overwrite the
  blocks. The device -> host copy overlaps the next forward pass. On loads,
  the host -> device copy and the scatter run on the side stream. The compute
  stream waits on an event, with no CPU stall. Some host buffers are pinned,
  because the host pool registers itself with ``cudaHostRegister``. Those are
  copied to and from directly with ``non_blocking=True``. Others go through a
  pinned staging buffer. Completion is an event the worker polls, through
  :meth:`Fence.poll`.

:func:`select_copier` picks one from the KV cache's device. The CUDA calls go
through :class:`CudaRuntime`, so tests run :class:`CudaCopier` on CPU tensors
with a stand-in runtime.
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
    """Shape of the rank's part (its heads only for split tensors)."""


@dataclass(frozen=True, slots=True)
class ShardMap:
    """A rank's tensors inside a chunk payload and inside a packed image of just those bytes.

    ``runs`` are the contiguous ``(payload_offset, image_offset, length)``
    pieces a transfer copies. At TP=1 there is one, the whole payload. At TP>1
    there are two per layer, its K and V heads.
    """

    tensors: tuple[ShardTensor, ...]
    """The rank's tensors, in payload order."""
    runs: tuple[tuple[int, int, int], ...]
    """Merged contiguous pieces (payload offset, image offset, length)."""
    image_size: int
    """Bytes of a packed image: the sum of the rank's parts."""
    payload_size: int
    """Bytes of a whole chunk payload."""

    @classmethod
    def build(cls, layout: ChunkLayout, rank: int, tp: int, *, for_write: bool) -> ShardMap:
        """The tensors rank ``rank`` of ``tp`` reads (``for_write=False``) or writes.

        Writers skip replicated heads they do not own. They also skip unsplit
        tensors such as MLA latents, unless they are rank 0. This is exactly as
        :meth:`ChunkLayout.rank_ranges` does.
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
        """Typed views of every tensor inside ``flat`` (uint8): a packed image or a payload."""
        out = {}
        for t in self.tensors:
            start = t.image_offset if image else t.payload_offset
            out[t.name] = flat[start : start + t.nbytes].view(dtype).view(t.shape)
        return out


# --- completion ------------------------------------------------------------------------------


class Fence:
    """Completion of one batch of copies. :meth:`poll` until true, or :meth:`wait`."""

    def poll(self) -> bool:
        """Whether the copies are complete (and any host-side finishing step has run)."""
        raise NotImplementedError

    def wait(self) -> None:
        """Block until complete."""
        raise NotImplementedError

    @property
    def seconds(self) -> float | None:
        """Time the copies took once complete (device time when measured on the device)."""
        raise NotImplementedError


class DoneFence(Fence):
    """Copies that completed before the fence was made (CPU, blocking copies)."""

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
    """Copies that complete when a device event does; holds their buffers until then.

    ``finish`` runs once on the host after the event (staging buffer -> host
    chunk buffer for saves into unpinned memory).
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
    """Per chunk, tensor name -> the rank's part on the device (fill it for saves, read it
    for loads)."""
    nbytes: int
    """Bytes moved between device and host by this batch."""
    fence: Fence | None = None
    """Set when the ``with`` block ends: completion of the copies."""
    keep: list[Any] = field(default_factory=list)
    """Buffers the copies read or write; the fence holds them until complete."""
    start: Any = None
    """Device event recorded before the copies (CUDA timing), or None."""


# --- copiers ------------------------------------------------------------------------------


def byte_tensor(buffer: Any) -> torch.Tensor:
    """A uint8 tensor over a host buffer (no copy; read-only buffers are fine for reads)."""
    with warnings.catch_warnings():
        # Host chunks are read-only bytes on loads; torch only warns about it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


class DeviceCopier:
    """Moves chunk payloads between host buffers and a device. See the module docstring.

    ``saving`` / ``loading`` are context managers: run the layout conversion
    inside the block (it is placed on the copier's stream), read
    ``batch.fence`` after it.
    """

    name = "abstract"
    device: torch.device

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """A long tensor of block or token indices on the device, without a host sync."""
        return torch.tensor(list(values), dtype=torch.long).to(self.device)

    def saving(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype
    ) -> contextlib.AbstractContextManager[Batch]:
        """Device tensors to fill with each chunk's rank part; copied into ``payloads`` after.

        ``payloads`` are writable host buffers of ``shard.payload_size`` bytes
        (the payload part of a chunk buffer). They must stay alive until the
        fence completes.
        """
        raise NotImplementedError

    def loading(
        self, payloads: Sequence[Any], shard: ShardMap, dtype: torch.dtype, *, block_compute: bool
    ) -> contextlib.AbstractContextManager[Batch]:
        """Device tensors holding each chunk's rank part, copied from ``payloads``.

        With ``block_compute`` the next forward pass waits for the block's
        work (synchronous loads); without it, the caller must not let the engine use
        the blocks before ``batch.fence`` completes.
        """
        raise NotImplementedError

    def settle(self) -> None:
        """Wait for device work a batch issued that no fence covers (one that failed part-way).

        Host and image copiers complete every copy before they return: nothing to wait for.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"


class HostCopier(DeviceCopier):
    """KV cache in host memory: canonical tensors are views of the chunk buffers themselves."""

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
    """Any torch device: packed device images, blocking copies run by run."""

    name = "image"

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    # Hooks the CUDA copier overrides; here: no streams, copies complete on return.

    def _on_side(self) -> contextlib.AbstractContextManager[Any]:
        """Context in which conversion and copies run; yields the compute stream (or None)."""
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
    """The torch.cuda calls :class:`CudaCopier` makes, in one place (tests substitute it)."""

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
    """CUDA: a side stream, pinned host memory, ``non_blocking`` copies, events the worker polls."""

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
        """Batches that went through a pinned staging buffer, for unpinned host memory."""
        self._warned_unpinned = False

    def index(self, values: Sequence[int]) -> torch.Tensor:
        # A pageable host tensor would make the copy synchronise the stream (and so wait for
        # the forward pass); from pinned memory it is queued like any other copy.
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
    """The copier for a KV cache on ``device``: host views on CPU, side stream on CUDA.

    Other devices, such as XPU and HPU, get blocking copies through device images.
    ``runtime`` replaces the torch.cuda calls, for tests.
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
