"""Where each tensor of a chunk lives, and which byte ranges each TP rank owns.

The canonical payload holds each layer's tensors, layer group by group, layer by layer.
Attention groups have ``k`` then ``v``, each ``[heads, tokens, head_dim]``.
MLA groups have ``latent``, ``[tokens, head_dim]``.
State groups have ``state``, of ``state_shape``.
Heads are outermost.
So the heads of TP rank ``r`` of ``t`` are one contiguous run inside each ``k`` or ``v`` tensor.
A rank's share is two ranges per layer, whatever the TP size that wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ConfigError, LayoutError
from chunkstore.format._dtypes import dtype_named
from chunkstore.format._header import HeaderTemplate
from chunkstore.format._spec import ATTENTION, MLA, SLIDING_WINDOW, KVSpec

if TYPE_CHECKING:
    import numpy as np

ALIGNMENT = 4096
"""The payload (safetensors data section) starts at a multiple of this many bytes."""


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One tensor of the canonical payload."""

    name: str
    """Header name, e.g. ``layers.3.k``."""
    layer: int
    """Global layer index."""
    role: str
    """``k``, ``v``, ``latent`` or ``state``."""
    shape: tuple[int, ...]
    """Full (all ranks) shape."""
    offset: int
    """Byte offset inside the payload."""
    nbytes: int
    """Size in bytes."""
    split_heads: bool
    """True when the first axis is KV heads, divided between TP ranks."""


@dataclass(frozen=True, slots=True)
class ByteRange:
    """A contiguous run of bytes inside a chunk file."""

    offset: int
    """Absolute offset from the start of the chunk file."""
    length: int
    """Number of bytes."""


@dataclass(frozen=True, slots=True)
class RankSlice:
    """The part of one tensor that a TP rank holds."""

    name: str
    """Tensor name."""
    offset: int
    """Byte offset of the part inside the payload."""
    nbytes: int
    """Size of the part in bytes."""
    shape: tuple[int, ...]
    """Shape of the part (the rank's heads first, for split tensors)."""


@dataclass(frozen=True, slots=True)
class RankShare:
    """Which heads of a ``num_heads``-head tensor a TP rank holds, and whether it writes them."""

    start: int
    """First head held."""
    stop: int
    """One past the last head held."""
    writer: bool
    """Whether this rank writes these heads (false for replicas when tp > heads)."""


def rank_share(rank: int, tp: int, num_heads: int) -> RankShare:
    """Heads of rank ``rank`` of ``tp``; with ``tp > num_heads`` heads are replicated, as
    vLLM does."""
    if tp <= 0 or not 0 <= rank < tp:
        raise ConfigError(f"rank must be in [0, tp), got rank={rank} tp={tp}")
    if num_heads % tp == 0:
        per_rank = num_heads // tp
        return RankShare(rank * per_rank, (rank + 1) * per_rank, True)
    if tp % num_heads == 0:
        replicas = tp // num_heads
        head = rank // replicas
        return RankShare(head, head + 1, rank % replicas == 0)
    raise ConfigError(f"tp={tp} neither divides nor is a multiple of {num_heads} KV heads")


class ChunkLayout:
    """Byte layout of every chunk of one :class:`KVSpec` (header size, offsets, TP ranges).

    All chunks of a spec have the same size, so a host pool can hold them in
    fixed-size slots. ``authenticated`` reserves room for a MAC in the header.
    """

    def __init__(self, spec: KVSpec, *, authenticated: bool = False) -> None:
        self.spec = spec
        self.authenticated = authenticated
        self.dtype = dtype_named(spec.dtype)
        self.fingerprint = spec.fingerprint()
        slots: list[TensorSlot] = []
        offset = 0
        tokens = spec.chunk_tokens
        for group in spec.groups:
            for layer in group.layers:
                specs: list[tuple[str, tuple[int, ...], bool]]
                if group.kind in (ATTENTION, SLIDING_WINDOW):
                    shape: tuple[int, ...] = (group.num_kv_heads, tokens, group.head_dim)
                    specs = [("k", shape, True), ("v", shape, True)]
                elif group.kind == MLA:
                    specs = [("latent", (tokens, group.head_dim), False)]
                else:
                    specs = [("state", tuple(group.state_shape), False)]
                for role, shape, split in specs:
                    nbytes = math.prod(shape) * self.dtype.itemsize
                    slots.append(
                        TensorSlot(
                            f"layers.{layer}.{role}", layer, role, shape, offset, nbytes, split
                        )
                    )
                    offset += nbytes
        self.tensors: tuple[TensorSlot, ...] = tuple(slots)
        self.by_name: dict[str, TensorSlot] = {t.name: t for t in slots}
        self.payload_size = offset
        self.template = HeaderTemplate.build(
            dtype=self.dtype.name,
            chunk_tokens=tokens,
            tensors=[(t.name, t.shape, t.offset, t.nbytes) for t in slots],
            payload_size=offset,
            authenticated=authenticated,
            alignment=ALIGNMENT,
        )
        self.data_offset = self.template.data_offset
        self.total_size = self.data_offset + self.payload_size

    def __repr__(self) -> str:
        return (
            f"ChunkLayout({self.spec.model_id!r}, tensors={len(self.tensors)}, "
            f"data_offset={self.data_offset}, total_size={self.total_size})"
        )

    # --- views ------------------------------------------------------------

    def tensor_view(self, buf: Any, name: str) -> np.ndarray:
        """A writable numpy view of tensor ``name`` inside chunk buffer ``buf`` (no copy)."""
        import numpy as np

        slot = self.by_name[name]
        start = self.data_offset + slot.offset
        flat = np.frombuffer(buf, dtype=np.uint8, count=slot.nbytes, offset=start)
        return flat.view(self.dtype.numpy).reshape(slot.shape)

    # --- TP ranks -----------------------------------------------------------

    def rank_slices(self, rank: int, tp: int, *, for_write: bool = False) -> list[RankSlice]:
        """Per tensor, the part TP rank ``rank`` of ``tp`` reads or writes, in payload order.

        Readers need their heads plus every unsplit tensor.
        MLA latents and states are unsplit: all ranks hold them.
        Writers skip unsplit tensors unless they are rank 0.
        They skip replicas of a head unless they own it.
        """
        slices: list[RankSlice] = []
        for slot in self.tensors:
            if slot.split_heads:
                share = rank_share(rank, tp, slot.shape[0])
                if for_write and not share.writer:
                    continue
                per_head = slot.nbytes // slot.shape[0]
                heads = share.stop - share.start
                slices.append(
                    RankSlice(
                        slot.name,
                        slot.offset + share.start * per_head,
                        heads * per_head,
                        (heads, *slot.shape[1:]),
                    )
                )
            elif not for_write or rank == 0:
                slices.append(RankSlice(slot.name, slot.offset, slot.nbytes, slot.shape))
        return slices

    def rank_ranges(self, rank: int, tp: int, *, for_write: bool = False) -> list[ByteRange]:
        """The byte ranges of a chunk file that TP rank ``rank`` of ``tp`` reads (or writes):
        :meth:`rank_slices` as absolute file offsets, adjacent ones merged, so at TP=1 the
        whole payload is one range."""
        ranges: list[ByteRange] = []
        for part in self.rank_slices(rank, tp, for_write=for_write):
            start = self.data_offset + part.offset
            if ranges and ranges[-1].offset + ranges[-1].length == start:
                ranges[-1] = ByteRange(ranges[-1].offset, ranges[-1].length + part.nbytes)
            else:
                ranges.append(ByteRange(start, part.nbytes))
        return ranges

    def shard_of(self, tensors: Mapping[str, Any], rank: int, tp: int) -> dict[str, Any]:
        """What rank ``rank`` of ``tp`` holds of whole-model ``tensors``.
        That is its heads of split tensors, and all of unsplit ones.
        These are slices, not copies.
        Works on numpy arrays, torch tensors, or anything sliceable along the first axis."""
        out: dict[str, Any] = {}
        for slot in self.tensors:
            full = tensors[slot.name]
            if slot.split_heads:
                share = rank_share(rank, tp, slot.shape[0])
                out[slot.name] = full[share.start : share.stop]
            else:
                out[slot.name] = full
        return out

    def shard_views(self, buf: Any, rank: int, tp: int) -> dict[str, np.ndarray]:
        """Views of the parts of every tensor that rank ``rank`` of ``tp`` holds, inside ``buf``."""
        full = {slot.name: self.tensor_view(buf, slot.name) for slot in self.tensors}
        return self.shard_of(full, rank, tp)

    def write_shard(self, buf: Any, rank: int, tp: int, shard: Mapping[str, Any]) -> None:
        """Copy rank ``rank``'s tensors (its heads only) into their places in chunk buffer ``buf``.

        Tensors this rank does not write are skipped.
        Those are replicas, and unsplit tensors off rank 0.
        So every rank may pass everything it has.
        """
        import numpy as np

        for name, view in self.shard_views(buf, rank, tp).items():
            slot = self.by_name[name]
            if slot.split_heads:
                if not rank_share(rank, tp, slot.shape[0]).writer:
                    continue
            elif rank != 0:
                continue
            if name not in shard:
                raise LayoutError(f"rank {rank}/{tp} shard lacks tensor {name}")
            source = np.asarray(shard[name])
            if source.shape != view.shape:
                raise LayoutError(f"{name}: shard shape {source.shape}, expected {view.shape}")
            np.copyto(view, source.view(view.dtype) if source.dtype != view.dtype else source)

    def read_shard(self, buf: Any, rank: int, tp: int) -> dict[str, np.ndarray]:
        """Views of rank ``rank``'s part of every tensor (zero-copy; copy them if buf is reused)."""
        return self.shard_views(buf, rank, tp)
