"""ZstdStore: a wrapper that keeps chunks zstd-compressed in another store, served uncompressed.

Compression is cross-cutting, so it is a wrapper over any store (an FS
directory, a bucket, a peer), not a flag in each backend. Chunks are
re-encoded with the payload compression of spec/FORMAT.md 4.4 on the way in
and decoded back to plain chunks, byte for byte, on the way out.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from chunkstore.backends._wrapper import WrapperStore
from chunkstore.backends.base import Buffer
from chunkstore.format import hot_bytes, recompress
from chunkstore.hashing import ChunkKey

__all__ = ["ZstdStore"]


class ZstdStore(WrapperStore):
    """Stores chunks zstd-compressed in ``inner`` and serves them uncompressed.

    The vLLM connector puts one in front of each secondary tier.
    So compression happens on the write-behind thread.
    Decompression happens on the prefetch threads.
    Host memory only ever holds chunks ready to copy.
    """

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        # A verifying inner store checked each compressed chunk's checksum: decompressing
        # does not hash it again (the zstd frame's content checksum and size still check the
        # payload, and the served chunk's checksum is computed over it here). Its ``verify``
        # as the read begins: a flag turned on meanwhile would vouch for unchecked bytes, and
        # the fresh checksum would hide their damage from every later check.
        verified = self.inner.verify
        return _uncompressed(self.inner.get_many(keys), verified=verified)

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> builtins.list[bytes | None]:
        return _uncompressed(self.inner.read_unchecked_many(keys), verified=False)

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self.inner.put_many([(k, recompress(d, "zstd")) for k, d in items])

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self.inner.put_if_absent_many([(k, recompress(d, "zstd")) for k, d in items])


def _uncompressed(found: Sequence[bytes | None], *, verified: bool) -> list[bytes | None]:
    return [None if d is None else hot_bytes(d, verified=verified) for d in found]
