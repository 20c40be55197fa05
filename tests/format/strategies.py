"""Hypothesis strategies for KV specs and chunk contents, and header surgery for format tests."""

from __future__ import annotations

import struct

import numpy as np
import xxhash
from hypothesis import strategies as st

from chunkstore.format import (
    ALIGNMENT,
    ATTENTION,
    MLA,
    SLIDING_WINDOW,
    STATE,
    ChunkLayout,
    KVSpec,
    LayerGroup,
)

DTYPES = ("BF16", "F16", "F8_E4M3", "F32")


@st.composite
def kv_specs(draw: st.DrawFn, *, attention_only: bool = False) -> KVSpec:
    """Random small specs: 1-3 groups of mixed kinds, any of the four dtypes."""
    n_groups = draw(st.integers(1, 3))
    groups = []
    layer = 0
    for _ in range(n_groups):
        kinds = (
            [ATTENTION, SLIDING_WINDOW]
            if attention_only
            else [ATTENTION, SLIDING_WINDOW, MLA, STATE]
        )
        kind = draw(st.sampled_from(kinds))
        count = draw(st.integers(1, 3))
        layers = tuple(range(layer, layer + count))
        layer += count
        if kind in (ATTENTION, SLIDING_WINDOW):
            heads = draw(st.sampled_from([1, 2, 4, 8]))
            groups.append(
                LayerGroup(
                    kind,
                    layers,
                    heads,
                    draw(st.integers(1, 16)),
                    sliding_window=draw(st.integers(1, 64)) if kind == SLIDING_WINDOW else None,
                )
            )
        elif kind == MLA:
            groups.append(LayerGroup(MLA, layers, 1, draw(st.integers(1, 24))))
        else:
            shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
            groups.append(LayerGroup(STATE, layers, state_shape=shape))
    return KVSpec(
        model_id=draw(st.text(min_size=1, max_size=12)),
        dtype=draw(st.sampled_from(DTYPES)),
        chunk_tokens=draw(st.integers(1, 40)),
        groups=tuple(groups),
    )


def random_tensors(layout: ChunkLayout, seed: int) -> dict[str, np.ndarray]:
    """Random bit patterns of the layout's dtype (NaNs too: bytes, not values, must survive)."""
    rng = np.random.default_rng(seed)
    return {
        slot.name: rng.integers(0, 256, slot.nbytes, dtype=np.uint8)
        .view(layout.dtype.numpy)
        .reshape(slot.shape)
        for slot in layout.tensors
    }


def split_chunk(data: bytes) -> tuple[bytes, bytes]:
    """(header JSON text without its padding, stored payload) of a chunk."""
    (header_len,) = struct.unpack_from("<Q", data, 0)
    return data[8 : 8 + header_len].rstrip(b" "), data[8 + header_len :]


def reseal(text: bytes, stored: bytes, padding: bytes = b"") -> bytes:
    """A chunk from header text and stored payload, padded and with a correct checksum, so a
    test's edit to the header is the chunk's only defect."""
    body = text + padding
    body += b" " * (-(8 + len(body)) % ALIGNMENT)
    head = bytearray(struct.pack("<Q", len(body)) + body)
    digits = head.index(b'"checksum":"xxh3-128:') + len(b'"checksum":"xxh3-128:')
    head[digits : digits + 32] = b"0" * 32
    head[digits : digits + 32] = xxhash.xxh3_128(bytes(head) + stored).hexdigest().encode()
    return bytes(head) + stored
