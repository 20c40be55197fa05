"""A cached chunk's place in its chain, for policies that follow chains.

A chunk key is a digest of its parent's digest and its tokens.
So the key alone does not name the parent. The chunk header does, see spec/FORMAT.md.
The host cache reads it once, when a chunk is published.
It passes it to the policy with :meth:`~chunkstore.cache.policy.CachePolicy.link`.
"""

from __future__ import annotations

from chunkstore.backends.base import Buffer
from chunkstore.errors import FormatError
from chunkstore.format import read_header
from chunkstore.hashing import ChunkKey, namespace_of


def chunk_parent(key: ChunkKey, data: Buffer) -> ChunkKey | None:
    """The key of the chunk before ``key``, read from the chunk header at the start of ``data``.

    ``None`` for a chain's first chunk, whose parent is the namespace root.
    The root's first bytes are the namespace.
    ``None`` too for bytes that are not a chunk, and for a header that names another key.
    """
    try:
        header = read_header(data)
    except FormatError:
        return None
    if header.key != key.digest or namespace_of(header.parent) == key.namespace:
        return None
    return ChunkKey(header.parent, key.namespace)
