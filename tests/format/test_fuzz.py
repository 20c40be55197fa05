"""Fuzzing the decoder: arbitrary and mutated bytes only ever raise FormatError subclasses."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.errors import FormatError
from chunkstore.format import ChunkLayout, decode_chunk
from chunkstore.testing.factories import make_chunks, small_spec

LAYOUT = ChunkLayout(small_spec(chunk_tokens=4, num_layers=1, num_kv_heads=2, head_dim=2))
GOOD = make_chunks(LAYOUT, np.arange(4, dtype=np.uint32))[0].data


def _decode_only_format_errors(data: bytes) -> None:
    for verify in (True, False):
        try:
            decode_chunk(data, verify=verify)
        except FormatError:
            pass


@settings(max_examples=300)
@given(st.binary(max_size=6000))
def test_arbitrary_bytes(data: bytes) -> None:
    _decode_only_format_errors(data)


@settings(max_examples=300)
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_after_a_valid_prefix(tail: bytes) -> None:
    _decode_only_format_errors(GOOD[:8] + b'{"__metadata__":{"chunkstore":"' + tail)


@settings(max_examples=400)
@given(
    st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, len(GOOD) + 16),
)
def test_mutated_chunks(edits: list[tuple[int, int]], length: int) -> None:
    data = bytearray(GOOD)
    for offset, value in edits:
        data[offset] = value
    _decode_only_format_errors(bytes(data[:length]) + b"\x00" * max(0, length - len(data)))


@settings(max_examples=200)
@given(st.data())
def test_mutated_header_json(data: st.DataObject) -> None:
    header_end = LAYOUT.data_offset
    text = bytearray(GOOD[8:header_end])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text) - 1))
        text[i] = data.draw(st.sampled_from(b'{}[]":,0123456789-eE.tfnul \\'))
    _decode_only_format_errors(GOOD[:8] + bytes(text) + GOOD[header_end:])
