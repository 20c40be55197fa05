"""Prefix-chained BLAKE3 chunk keys and namespace roots, see spec/FORMAT.md section 5.

``__all__`` is what users need to name chunks.
The names imported below it with ``as`` are the chain's building blocks.
They are importable from here too, for chunkstore's own modules and advanced use.
They are not part of the curated API.
"""

from chunkstore.hashing._keys import ChunkKey, chain_keys, namespace_of, namespace_root

# isort: split
# Importable here, not curated (see the module docstring).
from chunkstore.hashing._keys import DIGEST_SIZE as DIGEST_SIZE
from chunkstore.hashing._keys import chain_digest as chain_digest
from chunkstore.hashing._keys import check_namespace as check_namespace
from chunkstore.hashing._keys import encode_extra as encode_extra
from chunkstore.hashing._keys import is_namespace as is_namespace
from chunkstore.hashing._keys import parent_of as parent_of
from chunkstore.hashing._keys import tokens_as_le_u32 as tokens_as_le_u32

__all__ = ["ChunkKey", "chain_keys", "namespace_of", "namespace_root"]
