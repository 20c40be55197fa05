"""Conversion between vLLM's CPU primary-tier slots and canonical chunk payloads.

In vLLM 0.33, ``TieringOffloadingSpec`` keeps offloaded KV in one shared host
region of equal slots. vLLM calls them "chunks". Each slot is
``primary_kv_view.strides[0]`` bytes.

The default direct layout orders TP workers by rank. Each worker's part of a
slot holds its pages of every layer. The layers come in the KV cache group's
order. Each layer has ``blocks_per_chunk`` pages. A page is one block of the
layer's KV cache, as the attention backend stores it. It is ``[N, H, 2*D]``
for the ``LBNHC`` cache layout and ``[H, N, 2*D]`` for ``LBHNC``. The source is
vLLM 0.33's ``vllm/v1/kv_offload/cpu/shared_offload_region.py`` and
``offloading/worker.py``.

The :mod:`chunkstore.vllm.layouts` classes read and write each rank's pages.
The connector's :class:`~chunkstore.device.ShardMap` places each rank's heads.
So a chunk has the same bytes at any TP size or block size. Padding fills the
rest of the slot::

    slot = rank0(layer0 pages | layer1 pages | ...) | rank1(...) | ... | pad
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from chunkstore.device import ShardMap, byte_tensor
from chunkstore.errors import ConfigError
from chunkstore.format import ATTENTION, ChunkLayout
from chunkstore.vllm.engine import EngineKV
from chunkstore.vllm.layouts import FlashAttnLayout, FlashInferHNDLayout, PagedKVLayout

__all__ = ["PrimaryLayout", "TORCH_DTYPES"]

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
"""Chunk dtypes the tier converts: those a primary page of an attention layer holds."""

_PAGE_LAYOUTS: dict[str, type[PagedKVLayout]] = {
    "LBNHC": FlashAttnLayout,
    "LBHNC": FlashInferHNDLayout,
}
"""Map from vLLM's ``kv_cache_layout`` to the layout class with its page order."""


@dataclass(frozen=True, slots=True)
class _Region:
    """One rank's pages of one layer inside a slot."""

    offset: int
    """Byte offset inside the slot."""
    layer: int
    """Global layer index, as in the chunk tensor names ``layers.<layer>.k|v``."""
    heads: int
    """KV heads this rank holds."""


class PrimaryLayout:
    """Where one chunk's KV sits in a primary-tier slot; converts both ways."""

    def __init__(
        self,
        engine: EngineKV,
        *,
        tp_size: int,
        blocks_per_chunk: int,
        kv_cache_layout: str | None,
        layer_order: Sequence[str],
        slot_bytes: int,
    ) -> None:
        spec = engine.spec
        if any(group.kind != ATTENTION for group in spec.groups) or engine.num_groups != 1:
            raise ConfigError(
                "the chunkstore tier handles models with one full-attention KV cache group "
                "only (use ChunkStoreConnector for sliding-window, hybrid and MLA models)"
            )
        if spec.dtype not in TORCH_DTYPES:
            raise ConfigError(f"the chunkstore tier does not convert KV dtype {spec.dtype}")
        page_cls = _PAGE_LAYOUTS.get(kv_cache_layout or "LBNHC")
        if page_cls is None:
            raise ConfigError(
                f"kv_cache_layout {kv_cache_layout!r}: the chunkstore tier reads "
                f"{', '.join(_PAGE_LAYOUTS)} pages"
            )
        if blocks_per_chunk * engine.block_size != spec.chunk_tokens:
            raise ConfigError(
                f"offloaded chunks of {blocks_per_chunk} x {engine.block_size} tokens do not "
                f"match chunk_tokens {spec.chunk_tokens}"
            )
        self.layout: ChunkLayout = engine.layout
        """The canonical chunk layout."""
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.blocks_per_chunk = blocks_per_chunk
        self.slot_bytes = slot_bytes
        self.tp_size = tp_size
        head_dim = spec.groups[0].head_dim
        total_heads = spec.groups[0].num_kv_heads
        item = self.layout.dtype.itemsize
        self._page_cls = page_cls
        self._head_dim = head_dim
        self._block_size = engine.block_size
        self._regions: list[list[_Region]] = []
        self._write_maps = [
            ShardMap.build(self.layout, r, tp_size, for_write=True) for r in range(tp_size)
        ]
        self._read_maps = [
            ShardMap.build(self.layout, r, tp_size, for_write=False) for r in range(tp_size)
        ]
        offset = 0
        for rank in range(tp_size):
            regions = []
            heads = len(range(*_rank_heads(rank, tp_size, total_heads)))
            for name in layer_order:
                info = engine.layers.get(name)
                if info is None:
                    raise ConfigError(
                        f"layer {name!r} of the offloading config is not in the model"
                    )
                regions.append(_Region(offset, info.layer, heads))
                offset += blocks_per_chunk * heads * engine.block_size * 2 * head_dim * item
            self._regions.append(regions)
        self.kv_bytes = offset
        """Bytes of KV in a slot; the rest is padding."""
        self._whole = self._whole_slot_shape(tp_size, total_heads)
        # Gather block by block where a slot's token rows are a whole number of 4 KiB pages
        # apart. One copy of the whole 6-d view would then read each row's head_dim piece from
        # addresses 4 KiB apart, which share cache sets. Other row spacings and the load's
        # scatter keep the whole-slot copy.
        row = total_heads * 2 * head_dim * item
        self._gather_by_block = page_cls is FlashAttnLayout and row % 4096 == 0
        self._item = np.dtype(f"<u{item}")
        """Unsigned integers of the KV width, for the whole-slot copy of raw elements."""
        if offset > slot_bytes:
            raise ConfigError(
                f"vLLM's primary tier slots hold {slot_bytes} bytes, but {len(layer_order)} "
                f"layers x {tp_size} ranks of {blocks_per_chunk} blocks need {offset}: the "
                "engine's KV cache is not laid out as the chunkstore tier expects"
            )

    def _pages(self, slot: torch.Tensor, region: _Region) -> torch.Tensor:
        """The region's pages as the layout class's logical ``[B, H, N, 2*D]`` view."""
        n, h, bs, d2 = self.blocks_per_chunk, region.heads, self._block_size, 2 * self._head_dim
        nbytes = n * h * bs * d2 * self.layout.dtype.itemsize
        flat = slot[region.offset : region.offset + nbytes].view(self.dtype)
        if self._page_cls is FlashAttnLayout:
            return flat.view(n, bs, h, d2).permute(0, 2, 1, 3)
        return flat.view(n, h, bs, d2)

    def _page_layout(self, heads: int) -> PagedKVLayout:
        return self._page_cls(num_heads=heads, head_dim=self._head_dim, block_size=self._block_size)

    def _whole_slot_shape(self, tp_size: int, heads: int) -> tuple[int, ...] | None:
        """The payload as ``[L, 2, H, n, N, D]`` when one strided copy converts a whole slot.

        That is so when one rank's slot holds layers 0 to L-1 in order. The
        canonical payload ``layers.0.k, layers.0.v, layers.1.k, ...`` is then
        contiguous. The slot's pages and the payload view one 6-d array. Only
        their dimension orders differ. Strided numpy copies between them replace
        two torch copies per layer. Other cases go layer by layer. TP > 1 and
        reordered layers are such cases.
        """
        if tp_size != 1:
            return None
        regions = self._regions[0]
        tensors = {t.name: t for t in self.layout.tensors}
        per_tensor = self.blocks_per_chunk * heads * self._block_size * self._head_dim
        nbytes = per_tensor * self.layout.dtype.itemsize
        for index, region in enumerate(regions):
            k, v = tensors.get(f"layers.{index}.k"), tensors.get(f"layers.{index}.v")
            if region.layer != index or k is None or v is None:
                return None
            if (k.offset, k.nbytes, v.offset, v.nbytes) != (
                2 * index * nbytes,
                nbytes,
                (2 * index + 1) * nbytes,
                nbytes,
            ):
                return None
        if len(regions) * 2 * nbytes != self.layout.payload_size:
            return None
        n, bs, d = self.blocks_per_chunk, self._block_size, self._head_dim
        return (len(regions), 2, heads, n, bs, d)

    def _slot_as_payload(self, slot: Any) -> np.ndarray:
        """The slot's KV as the ``[L, 2, H, n, N, D]`` view of :meth:`_whole_slot_shape`.

        The view is numpy, not torch. A numpy copy is single-threaded and
        releases the GIL. The tier runs several jobs at once. Torch's intra-op
        threads per copy would oversubscribe the shared cores.
        """
        assert self._whole is not None
        layers, _, h, n, bs, d = self._whole
        flat = np.frombuffer(slot, np.uint8, self.kv_bytes).view(self._item)
        if self._page_cls is FlashAttnLayout:  # pages [n, N, H, 2, D]
            return flat.reshape(layers, n, bs, h, 2, d).transpose(0, 4, 3, 1, 2, 5)
        return flat.reshape(layers, n, h, bs, 2, d).transpose(0, 4, 2, 1, 3, 5)  # [n, H, N, 2, D]

    def _payload_array(self, payload: Any) -> np.ndarray:
        """A payload as the ``[L, 2, H, n, N, D]`` array of :meth:`_whole_slot_shape`."""
        assert self._whole is not None
        flat = np.frombuffer(payload, np.uint8, self.layout.payload_size).view(self._item)
        return flat.reshape(self._whole)

    def to_payload(self, slot: Any, payload: Any) -> None:
        """Fill a chunk ``payload`` from a ``slot``.

        ``payload`` is writable and ``layout.payload_size`` bytes long.
        """
        if self._whole is not None:
            source, target = self._slot_as_payload(slot), self._payload_array(payload)
            if not self._gather_by_block:
                np.copyto(target, source)
                return
            for block in range(target.shape[3]):
                np.copyto(target[:, :, :, block], source[:, :, :, block])
            return
        pages = byte_tensor(slot)
        out = byte_tensor(payload)
        for rank, regions in enumerate(self._regions):
            views = self._write_maps[rank].views(out, self.dtype, image=False)
            for region in regions:
                k_name, v_name = f"layers.{region.layer}.k", f"layers.{region.layer}.v"
                if k_name not in views:
                    continue  # a replicated head another rank writes
                self._page_layout(region.heads).gather_range(
                    self._pages(pages, region),
                    0,
                    self.blocks_per_chunk,
                    views[k_name],
                    views[v_name],
                )

    def from_payload(self, payload: Any, slot: Any) -> None:
        """Write a verified chunk ``payload`` into a ``slot``, with every rank's heads."""
        if self._whole is not None:
            np.copyto(self._slot_as_payload(slot), self._payload_array(payload))
            return
        pages = byte_tensor(slot)
        data = byte_tensor(payload)
        for rank, regions in enumerate(self._regions):
            views = self._read_maps[rank].views(data, self.dtype, image=False)
            for region in regions:
                k = views[f"layers.{region.layer}.k"]
                v = views[f"layers.{region.layer}.v"]
                layout = self._page_layout(region.heads)
                layout.scatter_range(self._pages(pages, region), 0, self.blocks_per_chunk, k, v)


def _rank_heads(rank: int, tp: int, heads: int) -> tuple[int, int]:
    from chunkstore.format import rank_share

    share = rank_share(rank, tp, heads)
    return share.start, share.stop
