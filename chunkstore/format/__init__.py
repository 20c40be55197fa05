"""The chunk format: KV description, byte layout, encode/decode (spec/FORMAT.md)."""

from chunkstore.format.chunk import (
    Chunk,
    PayloadVerifier,
    decode_chunk,
    decode_into,
    encode_chunk,
    header_bytes_needed,
    key_digest,
    mac_key_from_secret,
    read_header,
    recompress,
    seal_chunk,
)
from chunkstore.format.dtypes import DType, dtype_named
from chunkstore.format.header import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    READABLE_MAJORS,
    ChunkHeader,
    TensorEntry,
)
from chunkstore.format.hot import hot_bytes
from chunkstore.format.layout import (
    ALIGNMENT,
    ByteRange,
    ChunkLayout,
    RankShare,
    RankSlice,
    TensorSlot,
    rank_share,
)
from chunkstore.format.spec import (
    ATTENTION,
    KINDS,
    MLA,
    SLIDING_WINDOW,
    STATE,
    KVSpec,
    LayerGroup,
)

__all__ = [
    "ALIGNMENT",
    "ATTENTION",
    "FORMAT_VERSION",
    "KINDS",
    "MAX_HEADER_BYTES",
    "MLA",
    "READABLE_MAJORS",
    "SLIDING_WINDOW",
    "STATE",
    "ByteRange",
    "Chunk",
    "ChunkHeader",
    "ChunkLayout",
    "DType",
    "KVSpec",
    "LayerGroup",
    "PayloadVerifier",
    "RankShare",
    "RankSlice",
    "TensorEntry",
    "TensorSlot",
    "decode_chunk",
    "decode_into",
    "dtype_named",
    "encode_chunk",
    "header_bytes_needed",
    "hot_bytes",
    "key_digest",
    "mac_key_from_secret",
    "rank_share",
    "read_header",
    "recompress",
    "seal_chunk",
]
