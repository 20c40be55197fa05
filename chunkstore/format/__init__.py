"""The chunk format of spec/FORMAT.md: KV description, byte layout, encoding and decoding.

``__all__`` is what users of the format need.
The names imported below it with ``as`` are importable from here too.
They are for chunkstore's own modules and advanced use, such as TP byte ranges and header
parsing details.
They are not part of the curated API.
"""

from chunkstore.format._chunk import (
    Chunk,
    decode_chunk,
    decode_into,
    encode_chunk,
    mac_key_from_secret,
    read_header,
    recompress,
    seal_chunk,
)
from chunkstore.format._header import FORMAT_VERSION, ChunkHeader
from chunkstore.format._layout import ByteRange, ChunkLayout
from chunkstore.format._spec import KVSpec, LayerGroup, LayerKind

# isort: split
# Importable here, not curated (see the module docstring).
from chunkstore.format._chunk import PayloadVerifier as PayloadVerifier
from chunkstore.format._chunk import chain_link as chain_link
from chunkstore.format._chunk import check_identity as check_identity
from chunkstore.format._chunk import header_bytes_needed as header_bytes_needed
from chunkstore.format._chunk import key_digest as key_digest
from chunkstore.format._dtypes import DType as DType
from chunkstore.format._dtypes import dtype_named as dtype_named
from chunkstore.format._header import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from chunkstore.format._header import READABLE_MAJORS as READABLE_MAJORS
from chunkstore.format._header import TensorEntry as TensorEntry
from chunkstore.format._hot import hot_bytes as hot_bytes
from chunkstore.format._layout import ALIGNMENT as ALIGNMENT
from chunkstore.format._layout import RankShare as RankShare
from chunkstore.format._layout import RankSlice as RankSlice
from chunkstore.format._layout import TensorSlot as TensorSlot
from chunkstore.format._layout import rank_share as rank_share
from chunkstore.format._spec import ATTENTION as ATTENTION
from chunkstore.format._spec import KINDS as KINDS
from chunkstore.format._spec import MLA as MLA
from chunkstore.format._spec import SLIDING_WINDOW as SLIDING_WINDOW
from chunkstore.format._spec import STATE as STATE

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
