"""chunkstore: versioned, layout-independent LLM KV-cache chunks in tiers.

The curated API, in the manner of zarr and safetensors: describe a model's KV
(:class:`KVSpec`, :class:`LayerGroup`, :class:`LayerKind`), lay it out
(:class:`ChunkLayout`), key it (:func:`namespace_root`, :func:`chain_keys`,
:class:`ChunkKey`), encode and decode chunks (:func:`encode_chunk`,
:func:`decode_chunk`), store them (:func:`open_store`, :class:`Store`) and cache
them in host memory in front of the stores (:class:`HostCache`,
:class:`TieredStore`). Errors derive from :class:`ChunkStoreError`; bad chunk
bytes raise a :class:`FormatError`.

Everything else lives in the subpackages (``chunkstore.format``,
``chunkstore.hashing``, ``chunkstore.backends``, ``chunkstore.cache``,
``chunkstore.tiering``, ``chunkstore.vllm``). Each name loads its subpackage on first
use, so ``import chunkstore`` stays cheap: no numpy, fsspec, S3, peers or vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chunkstore import _lazy
from chunkstore._version import __version__
from chunkstore.errors import ChunkStoreError, FormatError

if TYPE_CHECKING:
    from chunkstore.format import (
        ChunkLayout,
        KVSpec,
        LayerGroup,
        LayerKind,
        decode_chunk,
        encode_chunk,
    )
    from chunkstore.hashing import ChunkKey, chain_keys, namespace_root

__all__ = [
    "ChunkKey",
    "ChunkLayout",
    "ChunkStoreError",
    "FormatError",
    "HostCache",
    "KVSpec",
    "LayerGroup",
    "LayerKind",
    "Store",
    "TieredStore",
    "__version__",
    "chain_keys",
    "decode_chunk",
    "encode_chunk",
    "namespace_root",
    "open_store",
]

# Note: the format and hashing need numpy, the backends fsspec, the host cache numpy pools;
# keeping them off the import path of `import chunkstore` lets `chunkstore --help` start
# without any of them, and format-only users pay nothing for stores and caches.
_LAZY = {
    "ChunkLayout": "chunkstore.format",
    "KVSpec": "chunkstore.format",
    "LayerGroup": "chunkstore.format",
    "LayerKind": "chunkstore.format",
    "decode_chunk": "chunkstore.format",
    "encode_chunk": "chunkstore.format",
    "ChunkKey": "chunkstore.hashing",
    "chain_keys": "chunkstore.hashing",
    "namespace_root": "chunkstore.hashing",
    "open_store": "chunkstore.backends",
    "Store": "chunkstore.backends",
    "HostCache": "chunkstore.cache",
    "TieredStore": "chunkstore.tiering",
}


def __getattr__(name: str) -> object:
    return _lazy.lazy_attribute(__name__, _LAZY, name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
