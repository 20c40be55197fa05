"""Headers built to hurt a reader (deep JSON nesting, huge shapes, zstd frames declaring far
more than they hold): each is a :class:`FormatError`, never another exception, and is
refused without allocating or computing in proportion to what the header claims."""

from __future__ import annotations

import struct

import pytest

from chunkstore.errors import LayoutError, MalformedHeader
from chunkstore.format import decode_chunk, read_header
from chunkstore.format._header import tensor_nbytes

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


def _state_chunk(dims: bytes, end: int = 1) -> bytes:
    return _padded(
        META + b',"layers.0.state":{"dtype":"U8","shape":[' + dims + b'],"data_offsets":[0,'
        b"%d]}}" % end
    )


def test_shape_whose_size_passes_any_offset_is_a_layout_error() -> None:
    huge = b",".join([b"999999999999999999"] * 3)
    with pytest.raises(LayoutError, match="do not fit"):
        decode_chunk(_state_chunk(huge, end=999_999_999_999_999_999))


def test_tensor_size_stops_at_the_first_dimension_past_the_bound() -> None:
    # the dimension after the overflow is never multiplied in: a header of ~900,000 huge
    # dimensions (16 MiB) costs one pass over them, not a product of millions of digits
    assert tensor_nbytes(2, [10**10, 10**10, None]) is None  # type: ignore[list-item]
    assert tensor_nbytes(2, [3, 4]) == 24
    assert tensor_nbytes(1, [10**17, 9]) == 9 * 10**17
    assert tensor_nbytes(1, [10**17, 10]) is None
