"""What a chunk header says: the versions and algorithms, and the validated fields."""

from __future__ import annotations

import binascii
import struct
from dataclasses import dataclass

FORMAT_VERSION = "1.0"
"""The version this library writes."""
CHECKSUM_ALGORITHM = "xxh3-128"
MAC_ALGORITHM = "blake3-keyed"
_LEN = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as the header describes it."""

    name: str
    """Tensor name."""
    dtype: str
    """safetensors dtype string."""
    shape: tuple[int, ...]
    """Shape."""
    offset: int
    """Start inside the (uncompressed) payload."""
    nbytes: int
    """Size in bytes."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """Everything a chunk header says, validated."""

    version: str
    """Format version the writer emitted (``"1.0"``)."""
    fingerprint: bytes
    """32-byte model/KV fingerprint."""
    namespace: str
    """16 hex digits: storage namespace."""
    key: bytes
    """32-byte chunk key digest."""
    parent: bytes
    """32-byte parent digest (the namespace root for a conversation's first chunk)."""
    token_bytes: bytes
    """Token ids the chunk covers, as little-endian uint32 bytes (what the key hashes)."""
    compression: str
    """``none`` or ``zstd``."""
    payload_size: int
    """Uncompressed payload bytes."""
    stored_size: int
    """Payload bytes as stored (equal to payload_size when uncompressed)."""
    checksum: bytes
    """16-byte xxh3-128 over header (checksum zeroed) and stored payload."""
    mac: bytes | None
    """32-byte keyed BLAKE3 MAC, if the writer authenticated the chunk."""
    tensors: tuple[TensorEntry, ...]
    """Tensor table in payload order."""
    data_offset: int
    """Byte offset of the payload in the file."""
    checksum_span: tuple[int, int]
    """Where the checksum hex lies in the file (zeroed when hashing)."""
    mac_span: tuple[int, int] | None
    """Where the MAC hex lies in the file (zeroed when computing the MAC)."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids the chunk covers."""
        return struct.unpack(f"<{len(self.token_bytes) // 4}I", self.token_bytes)


def _unhex(text: bytes) -> bytes | None:
    """The bytes that the lower-case hex digits ``text`` spell; None if ``text`` holds
    anything else (or an odd number of digits)."""
    # Note: a2b_hex also takes upper-case digits; the round trip (b2a_hex writes lower case)
    # refuses them, and both passes together cost less than one translate() over the text.
    try:
        value = binascii.a2b_hex(text)
    except binascii.Error:
        return None
    return value if binascii.b2a_hex(value) == text else None
