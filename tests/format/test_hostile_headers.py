"""Headers built to hurt a reader (deep JSON nesting, huge shapes, zstd frames declaring far
more than they hold): each is a :class:`FormatError`, never another exception, and is
refused without allocating or computing in proportion to what the header claims."""

from __future__ import annotations

import struct

import pytest

from chunkstore.errors import MalformedHeader
from chunkstore.format import decode_chunk, read_header

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
