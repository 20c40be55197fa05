"""Chunk stores: the interface (``base``) and its implementations, one module each.

``__all__`` is what users of stores need.
That is opening one by URL, the interface and its optional capabilities.
It is also the in-process store, the wrapper base, and the zstd wrapper built on it.
The filesystem and S3 stores are reached through :func:`open_store`.
Their modules, ``chunkstore.backends._fs`` and ``.s3``, hold their options.
"""

from chunkstore.backends._memory import MemoryStore
from chunkstore.backends._registry import open_store, register_scheme
from chunkstore.backends._wrapper import WrapperStore
from chunkstore.backends._zstd import ZstdStore
from chunkstore.backends.base import (
    ChunkInfo,
    Store,
    SupportsGetInto,
    SupportsGetManyInto,
    SupportsModelRecords,
    SupportsRangedRead,
)

# isort: split
# Importable here, not curated: the prefix search stores share.
from chunkstore.backends.base import binary_search_prefix as binary_search_prefix

__all__ = [
    "ChunkInfo",
    "MemoryStore",
    "Store",
    "SupportsGetInto",
    "SupportsGetManyInto",
    "SupportsModelRecords",
    "SupportsRangedRead",
    "WrapperStore",
    "ZstdStore",
    "open_store",
    "register_scheme",
]
