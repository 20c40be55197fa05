"""chunkstore: versioned, layout-independent LLM KV-cache chunks in tiers.

The core API is re-exported here; optional parts (S3, peers, vLLM) load lazily
so ``import chunkstore`` stays cheap and never needs their dependencies.
"""

from __future__ import annotations

from chunkstore._version import __version__
from chunkstore.errors import ChunkStoreError, FormatError
from chunkstore.format import ChunkLayout, KVSpec, LayerGroup, decode_chunk, encode_chunk
from chunkstore.hashing import ChunkKey, chain_keys, namespace_root

__all__ = [
    "ChunkKey",
    "ChunkLayout",
    "ChunkStoreError",
    "FormatError",
    "KVSpec",
    "LayerGroup",
    "__version__",
    "chain_keys",
    "decode_chunk",
    "encode_chunk",
    "namespace_root",
    "open_store",
]


def __getattr__(name: str) -> object:
    # Note: open_store pulls in the backends package; keep it off the import path of
    # `import chunkstore` so format-only users pay nothing for fsspec.
    if name == "open_store":
        from chunkstore.backends.registry import open_store

        return open_store
    raise AttributeError(f"module 'chunkstore' has no attribute {name!r}")
