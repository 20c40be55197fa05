"""Prefix-chained BLAKE3 chunk keys and namespace roots."""

from chunkstore.hashing.keys import (
    DIGEST_SIZE,
    ChunkKey,
    chain_digest,
    chain_keys,
    encode_extra,
    is_namespace,
    namespace_of,
    namespace_root,
    parent_of,
    tokens_as_le_u32,
)

__all__ = [
    "DIGEST_SIZE",
    "ChunkKey",
    "chain_digest",
    "chain_keys",
    "encode_extra",
    "is_namespace",
    "namespace_of",
    "namespace_root",
    "parent_of",
    "tokens_as_le_u32",
]
