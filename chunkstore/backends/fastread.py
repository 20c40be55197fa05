"""Read a chunk file into a buffer and verify it in the same pass (the local fast path).

Reading a whole 32 MiB chunk and then hashing it walks the data twice through
memory; here each block is hashed right after ``preadv`` copied it, while it
is still in the CPU cache, which is what keeps verified reads close to raw
reads. The verdict is exactly :func:`chunkstore.format.decode_chunk`'s with
``expected_key`` (checksum as spec/FORMAT.md defines it: xxh3-128 over the
header with the checksum field zeroed, then the stored payload); compressed
chunks go through ``decode_chunk`` itself.
"""

from __future__ import annotations

import os

from chunkstore.errors import LayoutError, TruncatedChunk
from chunkstore.format import PayloadVerifier, decode_chunk, header_bytes_needed, read_header

BLOCK = 256 * 1024
"""Bytes read and hashed per step: small enough to stay in L2 between the two."""


def _read_exact(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def read_into(fd: int, target: memoryview) -> int:
    """Fill ``target`` from the start of ``fd``; bytes read."""
    return _read_exact(fd, target, 0)


def read_verified_into(fd: int, target: memoryview, expected_key: bytes | None) -> None:
    """Fill ``target`` (exactly the file's size) from ``fd`` and validate it as a chunk.

    Raises a :class:`~chunkstore.errors.FormatError` subclass if the bytes are not a
    valid chunk (or not the one asked for); ``target`` then holds garbage.
    """
    size = len(target)
    first = min(size, BLOCK)
    if _read_exact(fd, target[:first], 0) < first:
        raise TruncatedChunk("chunk file shrank while being read")
    header_len = header_bytes_needed(bytes(target[:8])) if size >= 8 else size
    if first < header_len <= size:
        if _read_exact(fd, target[first:header_len], first) < header_len - first:
            raise TruncatedChunk("chunk file shrank while being read")
        first = header_len
    header = read_header(target[:first])  # raises BadMagic/TruncatedChunk/... like decode_chunk
    if header.compression != "none":
        rest = _read_exact(fd, target[first:], first)
        if first + rest < size:
            raise TruncatedChunk("chunk file shrank while being read")
        decode_chunk(target, expected_key=expected_key)
        return
    stored = size - header.data_offset
    if stored != header.stored_size:
        error = TruncatedChunk if stored < header.stored_size else LayoutError
        raise error(f"payload has {stored} bytes, header says {header.stored_size}")
    verifier = PayloadVerifier(header, target, expected_key=expected_key)
    if first > header.data_offset:
        verifier.update(target[header.data_offset : first])
    pos = max(first, header.data_offset)
    while pos < size:
        end = min(pos + BLOCK, size)
        block = target[pos:end]
        if _read_exact(fd, block, pos) < end - pos:
            raise TruncatedChunk("chunk file shrank while being read")
        verifier.update(block)
        pos = end
    verifier.finish()
