"""The chunk header: a safetensors JSON header whose ``__metadata__`` carries chunkstore fields.

This module reads headers: it checks the JSON and returns a :class:`ChunkHeader`.
Writing goes through a :class:`HeaderTemplate`, in ``_template``.
That module also reads headers of a known shape by position.
``_headertypes`` holds what a header says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import (
    BadMagic,
    FormatError,
    HeaderTooLarge,
    LayoutError,
    MalformedHeader,
    TruncatedChunk,
    UnknownCompression,
    UnknownDType,
    UnsupportedFeature,
    UnsupportedVersion,
)
from chunkstore.format._dtypes import dtype_named, is_known_dtype
from chunkstore.format._headertypes import (
    _LEN,
    CHECKSUM_ALGORITHM,
    MAC_ALGORITHM,
    _unhex,
)
from chunkstore.format._template import _learn, _parse_known

# isort: split
# Importable from here as before the header module was split.
from chunkstore.format._headertypes import FORMAT_VERSION as FORMAT_VERSION
from chunkstore.format._headertypes import ChunkHeader as ChunkHeader
from chunkstore.format._headertypes import TensorEntry as TensorEntry
from chunkstore.format._template import HeaderTemplate as HeaderTemplate
from chunkstore.format._template import _meta_fields as _meta_fields
from chunkstore.format._template import render_header as render_header

READABLE_MAJORS = frozenset({1})
"""Major versions this library reads (any minor: minors only add optional fields)."""
_METADATA_OPEN = b'{"__metadata__":{'
MAGIC = _METADATA_OPEN + b'"chunkstore":"'
"""Bytes 8.. of every chunk: the header must open with the chunkstore version field."""
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Readers refuse headers announced larger than this (a damaged length prefix)."""
COMPRESSIONS = ("none", "zstd")

KNOWN_MINOR = 0
"""Highest minor version of a readable major this reader knows all additions of."""
MAX_DECIMAL_DIGITS = 18
"""Integers (decimal strings and JSON numbers) have at most 18 digits: below 2**63."""

_VERSION = re.compile(rb"(0|[1-9][0-9]{0,8})\.(0|[1-9][0-9]{0,8})")
_MAX_VERSION_CHARS = 19
_DECIMAL = re.compile(rf"0|[1-9][0-9]{{0,{MAX_DECIMAL_DIGITS - 1}}}", re.ASCII)
_MAX_INT = 10**MAX_DECIMAL_DIGITS
_STRUCTURE_BYTES = b"{}[],:0123456789"
_STRING_BYTES = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\')
_TENSOR_MEMBERS = {"dtype", "shape", "data_offsets"}
_TENSOR_NAME = re.compile(r"layers\.(0|[1-9][0-9]{0,8})\.([a-z_]+)", re.ASCII)
_ROLE_RANKS = {"k": 3, "v": 3, "latent": 2, "state": 0}
"""Tensor roles of this version and the rank of their shape (0: any rank >= 1)."""
_TOKENS_AXIS = {"k": 1, "v": 1, "latent": 0}
"""Which axis of a role's shape is the chunk's tokens (C)."""
_META_FIELDS = frozenset(
    {
        "chunkstore",
        "fingerprint",
        "namespace",
        "key",
        "parent",
        "tokens",
        "compression",
        "payload_size",
        "stored_size",
        "mac",
        "checksum",
    }
)


def _hex_field(meta: dict[str, Any], name: str, width: int, prefix: str = "") -> bytes:
    value = meta.get(name)
    if not isinstance(value, str) or not value.startswith(prefix):
        raise MalformedHeader(f"header field {name!r} missing or not a {prefix or 'hex'} string")
    text = value[len(prefix) :]
    raw = _unhex(text.encode()) if len(text) == width else None
    if raw is None:
        raise MalformedHeader(f"header field {name!r} must be {width} lower-case hex digits")
    return raw


def _int_field(meta: dict[str, Any], name: str) -> int:
    value = meta.get(name)
    if not isinstance(value, str) or not _DECIMAL.fullmatch(value):
        raise MalformedHeader(
            f"header field {name!r} must be a decimal string without leading zeros "
            f"(at most {MAX_DECIMAL_DIGITS} digits)"
        )
    return int(value)


def _span(raw: bytes, marker: bytes, width: int) -> tuple[int, int]:
    first = raw.find(marker)
    if first < 0 or raw.rfind(marker) != first:
        raise MalformedHeader(f"header must hold {marker.decode()!r} exactly once")
    start = first + len(marker)
    return start, start + width


def _version_of(data: memoryview, header_len: int) -> tuple[str, int, int]:
    """The version string right after the magic, and its major and minor numbers.

    They are read from fixed bytes before anything else is checked.
    Every major version keeps the length prefix, the magic and the version there.
    So a chunk of an unknown major is recognised as unsupported, not damaged.
    That holds whatever else a later major changes.
    Input that ends before the closing quote is truncated.
    A ``header_len`` that ends the header before it is malformed in every major.
    See spec section 2.2.
    """
    start = 8 + len(MAGIC)
    window = bytes(data[start : start + _MAX_VERSION_CHARS + 1])
    end = window.find(b'"')
    if end < 0:
        if len(window) <= _MAX_VERSION_CHARS:
            raise TruncatedChunk(f"chunk is {len(data)} bytes and ends inside its version")
        raise MalformedHeader("format version is not a short quoted string")
    text = window[:end]
    match = _VERSION.fullmatch(text)
    if match is None:
        raise MalformedHeader(f"bad format version {text.decode('ascii', 'replace')!r}")
    if header_len < len(MAGIC) + end + 1:
        raise MalformedHeader(f"header_len {header_len} ends the header inside its version")
    major, minor = int(match.group(1)), int(match.group(2))
    if major not in READABLE_MAJORS:
        raise UnsupportedVersion(
            f"chunk format version {text.decode()} is not supported (this reader knows major "
            f"{', '.join(str(m) for m in sorted(READABLE_MAJORS))}); upgrade chunkstore"
        )
    return text.decode(), major, minor


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` object hook: a member name twice in one object is a defect (section 3.1)."""
    document: dict[str, Any] = {}
    for name, value in pairs:
        if name in document:
            raise MalformedHeader(f"header JSON has the member {name!r} twice in one object")
        document[name] = value
    return document


def _json_object(text: bytes) -> dict[str, Any]:
    try:
        document = json.loads(text, object_pairs_hook=_unique_members)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise MalformedHeader(f"header is not valid JSON: {exc}") from None
    except RecursionError:
        # A valid header nests three deep; arrays nested past the interpreter's recursion
        # limit (a few KiB of '[') must be damage like any other, not an escaping error.
        raise MalformedHeader("header JSON nests too deeply") from None
    if not isinstance(document, dict):
        raise MalformedHeader("header is not a JSON object")
    return document


def _split_document(body: bytes) -> tuple[dict[str, Any], bytes]:
    """Check header bytes against the lexical rules of section 3.1, and split them.

    The bytes are JSON text, then padding.
    Returns the parsed ``__metadata__`` object, and the tensor members' text.
    Strings hold printable ASCII other than ``"`` and ``\\``, so no escapes.
    Everything between strings is one of ``{}[],:`` or a digit: compact JSON, integers only.
    The padding after the closing brace is spaces only.
    With these rules a string's bytes are its value.
    That lets every reader find the checksum digits by byte search.
    And ``__metadata__``, strings only, ends at the first ``}`` outside a string.
    """
    # (The header holds the magic and the whole version: _version_of checked header_len.)
    text = body.rstrip(b" ")
    if not text.endswith(b"}"):
        raise MalformedHeader("header must be one JSON object followed by 0x20 padding only")
    parts = text.split(b'"')
    if len(parts) % 2 == 0:
        raise MalformedHeader("header JSON has an unterminated string")
    if b"".join(parts[0::2]).translate(None, _STRUCTURE_BYTES):
        raise MalformedHeader(
            "header JSON must be compact: no whitespace (padding is 0x20 after the object), "
            "no literals other than strings and non-negative integers"
        )
    if b"".join(parts[1::2]).translate(None, _STRING_BYTES):
        raise MalformedHeader("header strings must be printable ASCII with no escapes")
    offset = 0
    for index in range(2, len(parts), 2):
        offset += len(parts[index - 2]) + len(parts[index - 1]) + 2
        close = parts[index].find(b"}")
        if close >= 0:
            meta_end = offset + close + 1
            break
    else:
        raise MalformedHeader("header JSON has no complete __metadata__ object")
    meta = _json_object(text[len(_METADATA_OPEN) - 1 : meta_end])
    rest = text[meta_end:]
    if not rest.startswith(b","):
        raise MalformedHeader("header declares no tensors after __metadata__")
    return meta, rest[1:]


# Validated tensor tables by their exact header text: every chunk of one KV description
# shares its table, so a reader that sees many chunks of a few models (verify, a cold
# tier of zstd chunks) parses each table once. Only tables that passed are kept.
_KNOWN_TABLES: dict[bytes, tuple[tuple[TensorEntry, ...], int | None]] = {}
_MAX_KNOWN_TABLES = 64
_MAX_KNOWN_TABLE_BYTES = 256 * 1024


def _tensor_members(text: bytes) -> dict[str, Any] | None:
    """The tensor members' text, ``"name":{...},...}``, parsed as JSON.
    This is spec section 3.4 group 4.
    None for a table already validated, whose text is known."""
    if text in _KNOWN_TABLES:
        return None
    return _json_object(b"{" + text)


def _tensor_table(
    text: bytes, members: dict[str, Any] | None, newer: bool
) -> tuple[tuple[TensorEntry, ...], int | None]:
    """The tensor table validated (group 9); see :func:`_tensor_entries`. ``members`` is
    :func:`_tensor_members` of ``text``."""
    known = _KNOWN_TABLES.get(text)
    if known is not None:
        return known
    entries, chunk_tokens = _tensor_entries(
        members if members is not None else _json_object(b"{" + text), newer
    )
    table = (tuple(entries), chunk_tokens)
    if len(text) > _MAX_KNOWN_TABLE_BYTES:
        return table  # bounds the cache's memory whatever a store holds
    if len(_KNOWN_TABLES) >= _MAX_KNOWN_TABLES:
        del _KNOWN_TABLES[next(iter(_KNOWN_TABLES))]
    _KNOWN_TABLES[text] = table
    return table


def _unknown(newer: bool, error: type[UnsupportedVersion], what: str) -> FormatError:
    """Something the reader does not know: unsupported in a newer minor, else malformed."""
    if newer:
        return error(f"{what} (added by a newer minor version; upgrade chunkstore)")
    return MalformedHeader(f"{what} (not defined in this format version)")


def tensor_nbytes(itemsize: int, shape: Sequence[int]) -> int | None:
    """Bytes of a tensor of ``shape``, or None past the largest offset a header can hold.

    That offset is below ``10**18``.
    Such a shape cannot match its ``data_offsets``.
    It stops at the first dimension that passes the bound.
    A 16 MiB header holds ~900,000 dimensions.
    Multiplying them all out, a product of millions of digits, took minutes per chunk read.
    """
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
        if nbytes >= _MAX_INT:
            return None
    return nbytes


def _tensor_entries(tensors: dict[str, Any], newer: bool) -> tuple[list[TensorEntry], int | None]:
    """Validate the tensor table (section 3.2); also return C as the shapes imply it."""
    entries: list[TensorEntry] = []
    chunk_tokens: int | None = None
    dtype_seen: str | None = None
    layers_seen: set[str] = set()
    pending_k: TensorEntry | None = None
    cursor = 0
    # Unknown dtypes and roles first (spec section 3.4, group 6), so that a chunk of a newer
    # minor is classified unsupported whatever else its table holds.
    for name, entry in tensors.items():
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if isinstance(dtype, str) and not is_known_dtype(dtype):
            raise _unknown(newer, UnknownDType, f"tensor {name!r} has unknown dtype {dtype!r}")
        match = _TENSOR_NAME.fullmatch(name)
        if match is not None and match.group(2) not in _ROLE_RANKS:
            raise _unknown(newer, UnsupportedFeature, f"tensor {name!r} has unknown role")
    for name, entry in tensors.items():
        if not isinstance(entry, dict) or entry.keys() != _TENSOR_MEMBERS:
            raise MalformedHeader(
                f"tensor {name!r} must be an object of exactly dtype, shape and data_offsets"
            )
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str):
            raise MalformedHeader(f"tensor {name!r} has a dtype that is not a string")
        if dtype_seen is not None and dtype != dtype_seen:
            raise MalformedHeader(f"tensor {name!r} is {dtype}, earlier tensors {dtype_seen}")
        dtype_seen = dtype
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise MalformedHeader(f"tensor name {name!r} is not layers.<L>.<k|v|latent|state>")
        layer, role = match.group(1), match.group(2)
        if (
            not isinstance(shape, list)
            or not shape
            or not all(isinstance(d, int) and 0 < d < _MAX_INT for d in shape)
        ):
            raise MalformedHeader(f"tensor {name!r} has a bad shape {shape!r}")
        if _ROLE_RANKS[role] and len(shape) != _ROLE_RANKS[role]:
            raise MalformedHeader(f"tensor {name!r} must have {_ROLE_RANKS[role]} dimensions")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and o < _MAX_INT for o in offsets)
        ):
            raise MalformedHeader(f"tensor {name!r} has bad data_offsets")
        begin, end = offsets
        nbytes = tensor_nbytes(dtype_named(dtype).itemsize, shape)
        if nbytes is None or end - begin != nbytes:
            raise LayoutError(f"tensor {name!r}: offsets {offsets} do not fit shape and dtype")
        if begin != cursor:
            kind = "overlap" if begin < cursor else "hole"
            raise LayoutError(f"tensor {name!r} at {begin}: {kind} before it (at {cursor})")
        cursor = end
        current = TensorEntry(name, dtype, tuple(shape), begin, nbytes)
        # A layer is k then v (same shape), or one latent, or one state tensor.
        if pending_k is not None:
            if role != "v" or layer != pending_k.name.split(".")[1]:
                raise MalformedHeader(f"tensor {pending_k.name!r} must be followed by its v")
            if current.shape != pending_k.shape:
                raise MalformedHeader(f"tensor {name!r} differs in shape from its k")
            pending_k = None
        else:
            if role == "v":
                raise MalformedHeader(f"tensor {name!r} does not follow its k")
            if layer in layers_seen:
                raise MalformedHeader(f"layer {layer} appears twice in the tensor table")
            layers_seen.add(layer)
            if role == "k":
                pending_k = current
        tokens_axis = _TOKENS_AXIS.get(role)
        if tokens_axis is not None:
            if chunk_tokens is not None and shape[tokens_axis] != chunk_tokens:
                raise MalformedHeader(
                    f"tensor {name!r} covers {shape[tokens_axis]} tokens, "
                    f"earlier tensors {chunk_tokens}"
                )
            chunk_tokens = shape[tokens_axis]
        entries.append(current)
    if pending_k is not None:
        raise MalformedHeader(f"tensor {pending_k.name!r} must be followed by its v")
    if not entries:
        raise MalformedHeader("header declares no tensors")
    return entries, chunk_tokens


@dataclass(frozen=True, slots=True)
class OpenHeader:
    """A header past the checks that are frozen for its major version.
    Those are groups 1-5 of spec section 3.4.
    It holds all that checking the stored payload's length, checksum and MAC needs.
    It has not yet checked what a newer minor may add: compression, dtypes or tensor roles."""

    raw: bytes
    """Length prefix and header (with padding)."""
    version: str
    """Format version string."""
    newer: bool
    """Whether the minor is newer than this reader knows (unknown additions are unsupported)."""
    meta: dict[str, Any]
    """The ``__metadata__`` members."""
    tensors_text: bytes
    """The tensor members' JSON text (everything after ``__metadata__``)."""
    tensor_members: dict[str, Any] | None
    """That text parsed; None when it is a table already validated."""
    fingerprint: bytes
    namespace: str
    key: bytes
    parent: bytes
    token_bytes: bytes
    payload_size: int
    stored_size: int
    checksum: bytes
    mac: bytes | None
    checksum_span: tuple[int, int]
    mac_span: tuple[int, int] | None

    @property
    def data_offset(self) -> int:
        """Byte offset of the stored payload in the file."""
        return len(self.raw)


def open_header(data: memoryview) -> ChunkHeader | OpenHeader:
    """Run the checks of spec section 3.4 groups 1-5 on the header at the start of ``data``.

    Returns a complete :class:`ChunkHeader` when the header is of a layout this process knows.
    Such a header is read by position.
    Otherwise returns an :class:`OpenHeader` for :func:`complete_header`.
    Raises a :class:`~chunkstore.errors.FormatError` subclass for a defect of those groups.
    Raises :class:`~chunkstore.errors.UnsupportedVersion` for an unknown major.
    """
    size = len(data)
    probe = bytes(data[8 : 8 + len(MAGIC)])
    if probe != MAGIC[: len(probe)]:
        raise BadMagic("not a chunkstore chunk (header does not open with the chunkstore field)")
    if size < 8 + len(MAGIC):
        raise TruncatedChunk(f"chunk is {size} bytes, shorter than its header")
    (header_len,) = _LEN.unpack_from(data, 0)
    data_offset = 8 + header_len
    if header_len <= MAX_HEADER_BYTES and size >= data_offset:
        known = _parse_known(bytes(data[:data_offset]))
        if known is not None:
            return known
    version, _, minor = _version_of(data, header_len)
    if header_len > MAX_HEADER_BYTES:
        raise HeaderTooLarge(f"header announces {header_len} bytes (limit {MAX_HEADER_BYTES})")
    if size < data_offset:
        raise TruncatedChunk(f"chunk is {size} bytes, header needs {data_offset}")
    raw = bytes(data[:data_offset])
    newer = minor > KNOWN_MINOR
    meta, tensors_text = _split_document(raw[8:])
    tensor_members = _tensor_members(tensors_text)
    for name, value in meta.items():
        if not isinstance(value, str):
            raise MalformedHeader(f"header field {name!r} must be a string")
        if name not in _META_FIELDS and not newer:
            raise MalformedHeader(f"unknown header field {name!r} in a {version} chunk")
    tokens_text = meta.get("tokens")
    token_bytes = (
        _unhex(tokens_text.encode())
        if isinstance(tokens_text, str) and tokens_text and not len(tokens_text) % 8
        else None
    )
    if token_bytes is None:
        raise MalformedHeader("header field 'tokens' must be 8 lower-case hex digits per token")
    if not isinstance(meta.get("compression"), str):
        raise MalformedHeader("header field 'compression' is missing or not a string")
    mac = None
    mac_span = None
    if "mac" in meta:
        mac = _hex_field(meta, "mac", 64, f"{MAC_ALGORITHM}:")
        mac_span = _span(raw, f'"mac":"{MAC_ALGORITHM}:'.encode(), 64)
    return OpenHeader(
        raw=raw,
        version=version,
        newer=newer,
        meta=meta,
        tensors_text=tensors_text,
        tensor_members=tensor_members,
        fingerprint=_hex_field(meta, "fingerprint", 64),
        namespace=_hex_field(meta, "namespace", 16).hex(),
        key=_hex_field(meta, "key", 64),
        parent=_hex_field(meta, "parent", 64),
        token_bytes=token_bytes,
        payload_size=_int_field(meta, "payload_size"),
        stored_size=_int_field(meta, "stored_size"),
        checksum=_hex_field(meta, "checksum", 32, f"{CHECKSUM_ALGORITHM}:"),
        mac=mac,
        checksum_span=_span(raw, f'"checksum":"{CHECKSUM_ALGORITHM}:'.encode(), 32),
        mac_span=mac_span,
    )


def complete_header(opened: ChunkHeader | OpenHeader) -> ChunkHeader:
    """Finish what :func:`open_header` began: spec section 3.4 group 9 (compression, tensor
    table, tokens against the shapes). A chunk of a newer minor that uses an addition this
    reader lacks raises an :class:`~chunkstore.errors.UnsupportedVersion` kind."""
    if isinstance(opened, ChunkHeader):
        return opened
    newer = opened.newer
    compression = opened.meta["compression"]
    if compression not in COMPRESSIONS:
        raise _unknown(newer, UnknownCompression, f"unknown compression {compression!r}")
    entries, chunk_tokens = _tensor_table(opened.tensors_text, opened.tensor_members, newer)
    if chunk_tokens is not None and len(opened.token_bytes) != 4 * chunk_tokens:
        raise MalformedHeader(
            f"header field 'tokens' holds {len(opened.token_bytes) // 4} tokens, "
            f"the tensors {chunk_tokens}"
        )
    if compression == "none" and opened.stored_size != opened.payload_size:
        raise MalformedHeader("uncompressed chunk with stored_size != payload_size")
    cursor = entries[-1].offset + entries[-1].nbytes
    if cursor != opened.payload_size:
        raise LayoutError(f"tensors cover {cursor} bytes, payload_size says {opened.payload_size}")
    header = ChunkHeader(
        version=opened.version,
        fingerprint=opened.fingerprint,
        namespace=opened.namespace,
        key=opened.key,
        parent=opened.parent,
        token_bytes=opened.token_bytes,
        compression=compression,
        payload_size=opened.payload_size,
        stored_size=opened.stored_size,
        checksum=opened.checksum,
        mac=opened.mac,
        tensors=entries,
        data_offset=opened.data_offset,
        checksum_span=opened.checksum_span,
        mac_span=opened.mac_span,
    )
    _learn(opened.raw, header)
    return header


def parse_header(data: memoryview) -> ChunkHeader:
    """Validate and parse the header at the start of ``data``, the chunk file or more.

    Runs every header check of spec/FORMAT.md section 3.4, groups 1-5 and 9.
    It does not check the stored payload's length, checksum or MAC.
    Raises a :class:`~chunkstore.errors.FormatError` subclass for every defect.
    A chunk of an unknown major version raises an :class:`~chunkstore.errors.UnsupportedVersion`.
    So does one of a newer minor that uses what this reader lacks.
    From the header alone that is "unsupported, unverified".
    A damaged chunk can look so.
    :func:`decode_chunk` checks the checksum first for a known major.
    """
    return complete_header(open_header(data))
