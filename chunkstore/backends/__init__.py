"""Chunk stores: the interface (``base``) and its implementations, one module each."""

from chunkstore.backends.base import (
    ChunkInfo,
    Store,
    SupportsGetInto,
    SupportsGetManyInto,
    SupportsRangedRead,
    binary_search_prefix,
)
from chunkstore.backends.memory import MemoryStore
from chunkstore.backends.registry import open_store, register_scheme

__all__ = [
    "ChunkInfo",
    "MemoryStore",
    "Store",
    "SupportsGetInto",
    "SupportsGetManyInto",
    "SupportsRangedRead",
    "binary_search_prefix",
    "open_store",
    "register_scheme",
]
