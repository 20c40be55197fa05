"""The fused read+verify path gives exactly decode_chunk's verdict on every input."""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.backends.fastread import BLOCK, read_verified_into
from chunkstore.errors import FormatError
from chunkstore.format import ChunkLayout, decode_chunk, recompress
from chunkstore.testing.factories import sample_chunks, small_spec
from chunkstore.testing.store_suite import corrupt_copies

SMALL = sample_chunks(2, seed=8)
# several blocks of payload, so the block loop and its boundaries are exercised
BIG = sample_chunks(
    1,
    seed=9,
    layout=ChunkLayout(small_spec(chunk_tokens=64, num_layers=2, num_kv_heads=8, head_dim=256)),
)[0]
assert len(BIG.data) > 2 * BLOCK


def verdicts(data: bytes, expected_key: bytes) -> tuple[str, str]:
    try:
        decode_chunk(data, expected_key=expected_key)
        reference = "ok"
    except FormatError:
        reference = "bad"
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        target = memoryview(bytearray(len(data)))
        try:
            read_verified_into(f.fileno(), target, expected_key)
            fused = "ok"
        except FormatError:
            fused = "bad"
        if fused == "ok":
            assert bytes(target) == data
    return reference, fused


@pytest.mark.parametrize("chunk", [SMALL[0], BIG], ids=["small", "big"])
def test_valid_and_damaged(chunk: object) -> None:
    chunk_data = chunk.data  # type: ignore[attr-defined]
    key = chunk.key.digest  # type: ignore[attr-defined]
    assert verdicts(chunk_data, key) == ("ok", "ok")
    for damaged in corrupt_copies(chunk).values():  # type: ignore[arg-type]
        assert verdicts(damaged, key) == ("bad", "bad")
    assert verdicts(SMALL[1].data, key) == ("bad", "bad")  # another chunk's bytes


def test_compressed_chunk() -> None:
    pytest.importorskip("zstandard")
    packed = recompress(BIG.data, "zstd")
    assert verdicts(packed, BIG.key.digest) == ("ok", "ok")
    assert verdicts(packed[:-3], BIG.key.digest) == ("bad", "bad")


@settings(max_examples=60, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=len(BIG.data) - 1),
    bit=st.integers(min_value=0, max_value=7),
    cut=st.one_of(st.none(), st.integers(min_value=0, max_value=len(BIG.data) - 1)),
)
def test_any_bit_flip_or_truncation(position: int, bit: int, cut: int | None) -> None:
    data = bytearray(BIG.data)
    data[position] ^= 1 << bit
    if cut is not None:
        data = data[:cut]
    reference, fused = verdicts(bytes(data), BIG.key.digest)
    assert fused == reference
