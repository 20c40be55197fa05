"""The chunk format: KV description, byte layout, encode/decode (spec/FORMAT.md).

``__all__`` is what users of the format need. The names imported below it with
``as`` are importable from here too, for chunkstore's own modules and advanced
use (TP byte ranges, header parsing details), but are not part of the curated API.
"""

from chunkstore.format.chunk import (
    Chunk,
    decode_chunk,
    decode_into,
    encode_chunk,
    mac_key_from_secret,
    read_header,
    recompress,
    seal_chunk,
)
from chunkstore.format.header import FORMAT_VERSION, ChunkHeader
from chunkstore.format.layout import ByteRange, ChunkLayout
from chunkstore.format.spec import KVSpec, LayerGroup, LayerKind

# isort: split
# Importable here, not curated (see the module docstring).
from chunkstore.format.chunk import PayloadVerifier as PayloadVerifier
from chunkstore.format.chunk import header_bytes_needed as header_bytes_needed
from chunkstore.format.chunk import key_digest as key_digest
from chunkstore.format.dtypes import DType as DType
from chunkstore.format.dtypes import dtype_named as dtype_named
from chunkstore.format.header import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from chunkstore.format.header import READABLE_MAJORS as READABLE_MAJORS
from chunkstore.format.header import TensorEntry as TensorEntry
from chunkstore.format.hot import hot_bytes as hot_bytes
from chunkstore.format.layout import ALIGNMENT as ALIGNMENT
from chunkstore.format.layout import RankShare as RankShare
from chunkstore.format.layout import RankSlice as RankSlice
from chunkstore.format.layout import TensorSlot as TensorSlot
from chunkstore.format.layout import rank_share as rank_share
from chunkstore.format.spec import ATTENTION as ATTENTION
from chunkstore.format.spec import KINDS as KINDS
from chunkstore.format.spec import MLA as MLA
from chunkstore.format.spec import SLIDING_WINDOW as SLIDING_WINDOW
from chunkstore.format.spec import STATE as STATE

__all__ = [
    "FORMAT_VERSION",
    "ByteRange",
    "Chunk",
    "ChunkHeader",
    "ChunkLayout",
    "KVSpec",
    "LayerGroup",
    "LayerKind",
    "decode_chunk",
    "decode_into",
    "encode_chunk",
    "mac_key_from_secret",
    "read_header",
    "recompress",
    "seal_chunk",
]
