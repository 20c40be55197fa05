"""Chunks as host memory holds them: uncompressed, ready to copy to a device.

Cold tiers may keep chunks zstd-compressed, see spec/FORMAT.md §4.4.
Whatever brings one into host memory turns it back into the plain form first.
So every host slot can be read through the layout's views.

A compressed chunk that carries a MAC is the exception: it stays as it is.
Its MAC covers the header and the stored payload, and decompressing re-encodes both.
Host memory holds no MAC key to compute a new one.
Host memory is trusted, and never checks a MAC.
But its chunks leave it again, and must leave with the MAC they came with.
They are served to peers, whose readers hold the key and refuse a chunk without one.
They are also returned by reads, and copied by ``cp``.
Its readers decode it, as ``decode_chunk`` decompresses. Only such chunks pay that.
"""

from __future__ import annotations

from typing import Any

from chunkstore.errors import FormatError
from chunkstore.format._chunk import read_header, recompress


def hot_bytes(data: Any, *, verified: bool = False) -> Any:
    """``data`` as host memory should hold it: uncompressed, ready to copy to a device.

    ``verified`` says the store that served ``data`` checked its checksum.
    Decompressing then does not hash the compressed chunk again, see :func:`recompress`.
    The zstd frame's own content checksum and size still check the payload.
    Bytes that do not parse are returned as they are.
    The tier that served them already verified them.
    The host cache never interprets them otherwise.
    A chunk that carries a MAC is returned as it is too, see the module's docstring.
    """
    try:
        header = read_header(data)
        if header.compression == "none" or header.mac is not None:
            return data
        return recompress(data, "none", verify=not verified)
    except FormatError:
        return data


def decompress_in_place(view: memoryview, size: int, *, verified: bool = False) -> int:
    """Decompress a chunk read into ``view[:size]`` in place if it is compressed; its new size.

    0 when the uncompressed chunk does not fit in ``view`` (it cannot be held there).
    ``verified`` as for :func:`hot_bytes`; a chunk that carries a MAC is left compressed.
    """
    stored = view[:size]
    try:
        header = read_header(stored)
        if header.compression == "none" or header.mac is not None:
            return size
        if header.payload_size > len(view):
            # Its plain form cannot fit: known from the header, without decompressing
            # (run-length blocks expand 32,768-fold: a slot-sized frame can claim GiBs).
            return 0
        plain = recompress(stored, "none", verify=not verified)
    except FormatError:
        return size  # as hot_bytes: bytes that do not parse are left as they are
    if len(plain) > len(view):
        return 0
    view[: len(plain)] = plain
    return len(plain)
