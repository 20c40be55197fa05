"""Headers built to hurt a reader (deep JSON nesting, huge shapes, zstd frames declaring far
more than they hold): each is a :class:`FormatError`, never another exception, and is
refused without allocating or computing in proportion to what the header claims."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import xxhash

from chunkstore.errors import CompressionError, LayoutError, MalformedHeader
from chunkstore.format import decode_chunk, key_digest, read_header
from chunkstore.format._header import _meta_fields, render_header, tensor_nbytes
from chunkstore.format._hot import decompress_in_place

DEEP = b"[" * 100_000 + b"]" * 100_000
META = b'{"__metadata__":{"chunkstore":"1.0","compression":"none"}'


def _padded(body: bytes) -> bytes:
    """``body`` as a chunk's header: length prefix and 0x20 padding to 4096 bytes."""
    total = 8 + len(body)
    body += b" " * (-(-total // 4096) * 4096 - total)
    return struct.pack("<Q", len(body)) + body


@pytest.mark.parametrize(
    "body",
    [
        b'{"__metadata__":{"chunkstore":"1.0","x":' + DEEP + b'},"layers.0.state":{}}',
        META + b',"layers.0.state":' + DEEP + b"}",
        META + b',"layers.0.state":{"shape":' + DEEP + b"}}",
    ],
    ids=["metadata", "tensor", "tensor-member"],
)
def test_deeply_nested_json_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedHeader, match="nest"):
        decode_chunk(_padded(body))
    with pytest.raises(MalformedHeader, match="nest"):
        read_header(_padded(body))


def _state_meta(compression: str, *, payload_size: int, stored_size: int) -> list[tuple[str, str]]:
    """Well-formed metadata of a chunk of 4 zero tokens, parented by a zero root."""
    parent, tokens = bytes(32), bytes(16)
    return _meta_fields(
        version="1.0",
        fingerprint="0" * 64,
        namespace="0" * 16,
        key=key_digest(parent, tokens).hex(),
        parent=parent.hex(),
        tokens=tokens.hex(),
        compression=compression,
        payload_size=payload_size,
        stored_size=stored_size,
        mac=None,
        checksum="0" * 32,
    )


def _state_chunk(dims: bytes, end: int = 1) -> bytes:
    """A header whose metadata is well formed, with one U8 state tensor of shape ``dims``
    ending at ``end`` (the table is checked after the metadata: spec section 3.4)."""
    meta = _state_meta("none", payload_size=end, stored_size=end)
    text = render_header(meta, [], 1)[8:].rstrip(b" ")[:-1]  # the metadata object only
    return _padded(
        text + b',"layers.0.state":{"dtype":"U8","shape":[' + dims + b'],"data_offsets":[0,'
        b"%d]}}" % end
    )


def test_shape_whose_size_passes_any_offset_is_a_layout_error() -> None:
    huge = b",".join([b"999999999999999999"] * 3)
    with pytest.raises(LayoutError, match="do not fit"):
        read_header(_state_chunk(huge, end=999_999_999_999_999_999))


def test_tensor_size_stops_at_the_first_dimension_past_the_bound() -> None:
    # the dimension after the overflow is never multiplied in: a header of ~900,000 huge
    # dimensions (16 MiB) costs one pass over them, not a product of millions of digits
    assert tensor_nbytes(2, [10**10, 10**10, None]) is None  # type: ignore[list-item]
    assert tensor_nbytes(2, [3, 4]) == 24
    assert tensor_nbytes(1, [10**17, 9]) == 9 * 10**17
    assert tensor_nbytes(1, [10**17, 10]) is None


def _rle_zstd_chunk(declared: int, blocks: int = 1) -> bytes:
    """A valid chunk whose stored payload is one zstd frame of ``blocks`` RLE blocks of
    128 KiB zero bytes each, declaring ``declared`` content bytes, with a matching header
    and checksum."""
    content = xxhash.xxh64()
    for _ in range(blocks):
        content.update(bytes(131072))
    frame = b"\x28\xb5\x2f\xfd" + bytes([0xE4]) + struct.pack("<Q", declared)  # 8-byte FCS
    for last in [False] * (blocks - 1) + [True]:
        frame += ((131072 << 3) | (1 << 1) | last).to_bytes(3, "little") + b"\x00"  # RLE
    frame += struct.pack("<I", content.intdigest() & 0xFFFFFFFF)
    meta = _state_meta("zstd", payload_size=declared, stored_size=len(frame))
    state = [("layers.0.state", "U8", (declared,), 0, declared)]
    head = bytearray(render_header(meta, state, 4096))
    start, stop = read_header(bytes(head)).checksum_span
    head[start:stop] = xxhash.xxh3_128(bytes(head) + frame).hexdigest().encode()
    return bytes(head) + frame


def test_zstd_frame_declaring_more_than_its_blocks_hold_is_refused_before_allocating() -> None:
    # 4 KiB on disk, 10**17 bytes declared: a verdict, not a MemoryError
    with pytest.raises(CompressionError, match="hold at most 131072"):
        decode_chunk(_rle_zstd_chunk(10**17))
    with pytest.raises(CompressionError, match="hold at most 131072"):
        decode_chunk(_rle_zstd_chunk(131073))


def test_zstd_frame_whose_blocks_hold_the_declared_size_decodes() -> None:
    """The control: the bound is exact, a frame that does hold its content size is read."""
    chunk = decode_chunk(_rle_zstd_chunk(131072))
    assert bytes(chunk.payload) == bytes(131072)


def test_compressed_chunk_too_big_for_its_slot_is_not_decompressed() -> None:
    """A host slot (64 KiB here) holding a verified zstd chunk whose plain form (64 MiB of
    run-length blocks) cannot fit: refused from its header, not decompressed to find out."""
    blocks = 512
    data = _rle_zstd_chunk(blocks * 131072, blocks)
    slot = bytearray(64 * 1024)
    slot[: len(data)] = data
    tracemalloc.start()
    try:
        assert decompress_in_place(memoryview(slot), len(data)) == 0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert len(decode_chunk(data).payload) == blocks * 131072  # the control: a valid chunk
