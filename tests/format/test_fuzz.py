"""Fuzzing the decoder: arbitrary and mutated bytes only ever raise FormatError subclasses,
and each strict rule of spec/FORMAT.md 3.1 and 4.4 (duplicate members, padding, token width,
zstd frames), generated on an otherwise valid chunk, raises exactly its error."""

from __future__ import annotations

import re

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.errors import CompressionError, FormatError, MalformedHeader
from chunkstore.format import ChunkLayout, decode_chunk, key_digest
from chunkstore.testing.factories import make_chunks, small_spec
from tests.format.strategies import reseal, split_chunk

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


# --- the strict rules of spec section 3.1 and 4.4, each generated on a resealed chunk -------

TEXT, STORED = split_chunk(GOOD)
_SCALAR_MEMBER = re.compile(rb'"[^"]+":(?:"[^"]*"|\[[^\]]*\])')
_OBJECT_MEMBER = re.compile(rb'"[^"]+":\{[^{}]*\}')
MEMBERS = [m.span() for m in _SCALAR_MEMBER.finditer(TEXT)] + [
    m.span() for m in _OBJECT_MEMBER.finditer(TEXT)
]


@settings(max_examples=150)
@given(st.sampled_from(MEMBERS), st.integers(0, 2**16), st.booleans())
def test_duplicate_members_anywhere_are_malformed(
    span: tuple[int, int], noise: int, change_value: bool
) -> None:
    start, end = span
    member = TEXT[start:end]
    if change_value:  # the copy disagrees with the original: still refused, never one of them
        digit = member.rfind(b"0")
        if digit > member.index(b":"):
            member = member[:digit] + str(noise % 10).encode() + member[digit + 1 :]
    data = reseal(TEXT[:end] + b"," + member + TEXT[end:], STORED)
    with pytest.raises(MalformedHeader):
        decode_chunk(data)


@settings(max_examples=150)
@given(st.integers(0, 200), st.integers(0, 255).filter(lambda b: b != 0x20))
def test_padding_other_than_spaces_is_malformed(position: int, byte: int) -> None:
    padding = b" " * position + bytes([byte])
    with pytest.raises(MalformedHeader):
        decode_chunk(reseal(TEXT, STORED, padding))


@settings(max_examples=100)
@given(
    st.integers(1, 3 * LAYOUT.spec.chunk_tokens).filter(lambda n: n != LAYOUT.spec.chunk_tokens),
    st.integers(0, 2**32 - 1),
)
def test_token_width_other_than_c_is_malformed(count: int, seed: int) -> None:
    header = decode_chunk(GOOD).header
    tokens = np.random.default_rng(seed).integers(0, 2**32, count, dtype=np.uint32)
    token_hex = tokens.astype("<u4").tobytes().hex().encode()
    key = key_digest(header.parent, tokens).hex().encode()
    text = TEXT.replace(header.token_bytes.hex().encode(), token_hex)
    text = text.replace(header.key.hex().encode(), key)  # the key matches the tokens it holds
    with pytest.raises(MalformedHeader):
        decode_chunk(reseal(text, STORED))


@settings(max_examples=80)
@given(
    st.integers(1, 19),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2),
    st.binary(max_size=6),
    st.booleans(),
)
def test_zstd_frames_need_one_checksummed_sized_frame(
    level: int, checksum: bool, content_size: bool, extra_frames: int, tail: bytes, zeros: bool
) -> None:
    payload = bytes(len(STORED)) if zeros else STORED  # zeros: RLE blocks
    compressor = zstandard.ZstdCompressor(
        level=level, write_checksum=checksum, write_content_size=content_size
    )
    frame = compressor.compress(payload)
    stored = frame * (1 + extra_frames) + tail
    text = TEXT.replace(b'"compression":"none"', b'"compression":"zstd"')
    text = text.replace(
        f'"stored_size":"{len(STORED)}"'.encode(), f'"stored_size":"{len(stored)}"'.encode()
    )
    data = reseal(text, stored)
    if checksum and content_size and not extra_frames and not tail:
        assert bytes(decode_chunk(data).payload) == payload
    else:
        with pytest.raises(CompressionError):
            decode_chunk(data)


def test_zstd_frame_of_one_rle_block_is_read() -> None:
    """A frame written by hand (RFC 8878): single-segment header, one RLE block, checksum."""
    payload = b"\x2a" * len(STORED)
    assert len(payload) < 256  # fits the one-byte Frame_Content_Size of this header
    block = (1 | 1 << 1 | len(payload) << 3).to_bytes(3, "little")  # last, RLE, size
    digest = (xxhash.xxh64(payload).intdigest() & 0xFFFFFFFF).to_bytes(4, "little")
    frame = b"\x28\xb5\x2f\xfd" + bytes([0x24, len(payload)]) + block + b"\x2a" + digest
    text = TEXT.replace(b'"compression":"none"', b'"compression":"zstd"')
    text = text.replace(
        f'"stored_size":"{len(STORED)}"'.encode(), f'"stored_size":"{len(frame)}"'.encode()
    )
    assert bytes(decode_chunk(reseal(text, frame)).payload) == payload
    longer = text.replace(
        f'"stored_size":"{len(frame)}"'.encode(), f'"stored_size":"{len(frame) + 1}"'.encode()
    )
    with pytest.raises(CompressionError):  # the same frame with a byte after it
        decode_chunk(reseal(longer, frame + b"\0"))
