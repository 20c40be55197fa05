"""The chunk header: a safetensors JSON header whose ``__metadata__`` carries chunkstore fields.

Writing goes through a :class:`HeaderTemplate`: every field of an uncompressed
chunk has a fixed width (hex digests, 8 hex digits per token), so one template
per spec is rendered by overwriting byte ranges, without JSON encoding per chunk.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import (
    BadMagic,
    HeaderTooLarge,
    LayoutError,
    MalformedHeader,
    TruncatedChunk,
    UnsupportedVersion,
)
from chunkstore.format.dtypes import dtype_named, is_known_dtype

FORMAT_VERSION = "1.0"
"""The version this library writes."""
READABLE_MAJORS = frozenset({1})
"""Major versions this library reads (any minor: minors only add optional fields)."""
MAGIC = b'{"__metadata__":{"chunkstore":"'
"""Bytes 8.. of every chunk: the header must open with the chunkstore version field."""
MAX_HEADER_BYTES = 16 * 1024 * 1024
"""Readers refuse headers announced larger than this (a damaged length prefix)."""
CHECKSUM_ALGORITHM = "xxh3-128"
MAC_ALGORITHM = "blake3-keyed"
COMPRESSIONS = ("none", "zstd")

_HEX = re.compile(rb"[0-9a-f]*")
_VERSION = re.compile(r"(\d+)\.(\d+)")
_LEN = struct.Struct("<Q")


def _meta_fields(
    *,
    version: str,
    fingerprint: str,
    namespace: str,
    key: str,
    parent: str,
    tokens: str,
    compression: str,
    payload_size: int,
    stored_size: int,
    mac: str | None,
    checksum: str,
) -> list[tuple[str, str]]:
    fields = [
        ("chunkstore", version),
        ("fingerprint", fingerprint),
        ("namespace", namespace),
        ("key", key),
        ("parent", parent),
        ("tokens", tokens),
        ("compression", compression),
        ("payload_size", str(payload_size)),
        ("stored_size", str(stored_size)),
    ]
    if mac is not None:
        fields.append(("mac", f"{MAC_ALGORITHM}:{mac}"))
    fields.append(("checksum", f"{CHECKSUM_ALGORITHM}:{checksum}"))
    return fields


def render_header(
    meta: Sequence[tuple[str, str]],
    tensors: Sequence[tuple[str, str, tuple[int, ...], int, int]],
    alignment: int,
) -> bytes:
    """Length prefix + compact JSON header, space-padded so the payload starts aligned."""
    parts = ['{"__metadata__":{']
    parts.append(",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in meta))
    parts.append("}")
    for name, dtype, shape, offset, nbytes in tensors:
        shape_text = ",".join(str(d) for d in shape)
        parts.append(
            f',{json.dumps(name)}:{{"dtype":"{dtype}","shape":[{shape_text}],'
            f'"data_offsets":[{offset},{offset + nbytes}]}}'
        )
    parts.append("}")
    body = "".join(parts).encode()
    total = 8 + len(body)
    padded = -(-total // alignment) * alignment
    body += b" " * (padded - total)
    return _LEN.pack(len(body)) + body


@dataclass(frozen=True, slots=True)
class HeaderTemplate:
    """A rendered header with placeholder values and the byte position of each variable field."""

    raw: bytes
    """Length prefix and header, placeholders zeroed."""
    positions: dict[str, tuple[int, int]]
    """Field name -> (start, stop) of its variable value inside :attr:`raw`."""
    entries: tuple[TensorEntry, ...]
    """The tensor table this header declares, in payload order."""
    payload_size: int
    """Payload bytes."""

    @property
    def data_offset(self) -> int:
        """Where the payload starts (a multiple of the alignment)."""
        return len(self.raw)

    @classmethod
    def build(
        cls,
        *,
        dtype: str,
        chunk_tokens: int,
        tensors: Sequence[tuple[str, tuple[int, ...], int, int]],
        payload_size: int,
        authenticated: bool,
        alignment: int,
    ) -> HeaderTemplate:
        """Render the header of an uncompressed chunk with zeroed digests and tokens."""
        widths = {
            "fingerprint": 64,
            "namespace": 16,
            "key": 64,
            "parent": 64,
            "tokens": 8 * chunk_tokens,
            "mac": 64,
            "checksum": 32,
        }
        meta = _meta_fields(
            version=FORMAT_VERSION,
            fingerprint="0" * 64,
            namespace="0" * 16,
            key="0" * 64,
            parent="0" * 64,
            tokens="0" * widths["tokens"],
            compression="none",
            payload_size=payload_size,
            stored_size=payload_size,
            mac="0" * 64 if authenticated else None,
            checksum="0" * 32,
        )
        raw = render_header(meta, [(n, dtype, s, o, b) for n, s, o, b in tensors], alignment)
        positions: dict[str, tuple[int, int]] = {}
        for name, width in widths.items():
            if name == "mac" and not authenticated:
                continue
            marker = f'"{name}":"'.encode()
            if name == "mac":
                marker += f"{MAC_ALGORITHM}:".encode()
            elif name == "checksum":
                marker += f"{CHECKSUM_ALGORITHM}:".encode()
            start = raw.index(marker) + len(marker)
            positions[name] = (start, start + width)
        entries = tuple(TensorEntry(n, dtype, tuple(s), o, b) for n, s, o, b in tensors)
        template = cls(raw, positions, entries, payload_size)
        _remember(template)
        return template


# Templates of the layouts this process has built, by header length. Decoding a chunk whose
# fixed bytes equal a known template skips JSON parsing: the fields are read at known
# positions. Anything else takes the general JSON path, so foreign writers still work.
_KNOWN_TEMPLATES: dict[int, list[HeaderTemplate]] = {}
_MAX_TEMPLATES_PER_LENGTH = 8


def _remember(template: HeaderTemplate) -> None:
    bucket = _KNOWN_TEMPLATES.setdefault(len(template.raw), [])
    if template not in bucket:
        bucket.insert(0, template)
        del bucket[_MAX_TEMPLATES_PER_LENGTH:]


def _parse_known(raw: bytes) -> ChunkHeader | None:
    """Parse ``raw`` by position if its fixed bytes match a known template, else None."""
    for template in _KNOWN_TEMPLATES.get(len(raw), ()):
        skeleton = bytearray(raw)
        for start, stop in template.positions.values():
            skeleton[start:stop] = b"0" * (stop - start)
        if skeleton != template.raw:
            continue
        values: dict[str, bytes] = {}
        for name, (start, stop) in template.positions.items():
            text = raw[start:stop]
            if not _HEX.fullmatch(text):
                raise MalformedHeader(f"header field {name!r} must be lower-case hex digits")
            values[name] = bytes.fromhex(text.decode())
        tokens = values["tokens"]
        return ChunkHeader(
            version=FORMAT_VERSION,
            fingerprint=values["fingerprint"],
            namespace=values["namespace"].hex(),
            key=values["key"],
            parent=values["parent"],
            token_bytes=tokens,
            compression="none",
            payload_size=template.payload_size,
            stored_size=template.payload_size,
            checksum=values["checksum"],
            mac=values.get("mac"),
            tensors=template.entries,
            data_offset=len(raw),
            checksum_span=template.positions["checksum"],
            mac_span=template.positions.get("mac"),
        )
    return None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as the header describes it."""

    name: str
    """Tensor name."""
    dtype: str
    """safetensors dtype string."""
    shape: tuple[int, ...]
    """Shape."""
    offset: int
    """Start inside the (uncompressed) payload."""
    nbytes: int
    """Size in bytes."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """Everything a chunk header says, validated."""

    version: str
    """Format version the writer emitted (``"1.0"``)."""
    fingerprint: bytes
    """32-byte model/KV fingerprint."""
    namespace: str
    """16 hex digits: storage namespace."""
    key: bytes
    """32-byte chunk key digest."""
    parent: bytes
    """32-byte parent digest (the namespace root for a conversation's first chunk)."""
    token_bytes: bytes
    """Token ids the chunk covers, as little-endian uint32 bytes (what the key hashes)."""
    compression: str
    """``none`` or ``zstd``."""
    payload_size: int
    """Uncompressed payload bytes."""
    stored_size: int
    """Payload bytes as stored (equal to payload_size when uncompressed)."""
    checksum: bytes
    """16-byte xxh3-128 over header (checksum zeroed) and stored payload."""
    mac: bytes | None
    """32-byte keyed BLAKE3 MAC, if the writer authenticated the chunk."""
    tensors: tuple[TensorEntry, ...]
    """Tensor table in payload order."""
    data_offset: int
    """Byte offset of the payload in the file."""
    checksum_span: tuple[int, int]
    """Where the checksum hex lies in the file (zeroed when hashing)."""
    mac_span: tuple[int, int] | None
    """Where the MAC hex lies in the file (zeroed when computing the MAC)."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids the chunk covers."""
        return struct.unpack(f"<{len(self.token_bytes) // 4}I", self.token_bytes)


def _hex_field(meta: dict[str, Any], name: str, width: int, prefix: str = "") -> bytes:
    value = meta.get(name)
    if not isinstance(value, str) or not value.startswith(prefix):
        raise MalformedHeader(f"header field {name!r} missing or not a {prefix or 'hex'} string")
    text = value[len(prefix) :]
    if len(text) != width or not _HEX.fullmatch(text.encode()):
        raise MalformedHeader(f"header field {name!r} must be {width} lower-case hex digits")
    return bytes.fromhex(text)


def _int_field(meta: dict[str, Any], name: str) -> int:
    value = meta.get(name)
    if not isinstance(value, str) or not value.isdigit() or len(value) > 18:
        raise MalformedHeader(f"header field {name!r} must be a decimal string")
    return int(value)


def _span(raw: bytes, marker: bytes, width: int) -> tuple[int, int]:
    first = raw.find(marker)
    if first < 0 or raw.rfind(marker) != first:
        raise MalformedHeader(f"header must hold {marker.decode()!r} exactly once")
    start = first + len(marker)
    return start, start + width


def parse_header(data: memoryview) -> ChunkHeader:
    """Validate and parse the header at the start of ``data`` (the whole chunk file or more).

    Raises a :class:`~chunkstore.errors.FormatError` subclass for every defect:
    short input, foreign bytes, oversized or malformed header, unknown major
    version, and tensor tables with holes or overlaps.
    """
    size = len(data)
    probe = bytes(data[8 : 8 + len(MAGIC)])
    if probe != MAGIC[: len(probe)]:
        raise BadMagic("not a chunkstore chunk (header does not open with the chunkstore field)")
    if size < 8 + len(MAGIC):
        raise TruncatedChunk(f"chunk is {size} bytes, shorter than its header")
    (header_len,) = _LEN.unpack_from(data, 0)
    if header_len > MAX_HEADER_BYTES:
        raise HeaderTooLarge(f"header announces {header_len} bytes (limit {MAX_HEADER_BYTES})")
    data_offset = 8 + header_len
    if size < data_offset:
        raise TruncatedChunk(f"chunk is {size} bytes, header needs {data_offset}")
    raw = bytes(data[:data_offset])
    known = _parse_known(raw)
    if known is not None:
        return known
    try:
        document = json.loads(raw[8:].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedHeader(f"header is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("__metadata__"), dict):
        raise MalformedHeader("header has no __metadata__ object")
    meta = document.pop("__metadata__")
    version = meta.get("chunkstore")
    match = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if match is None:
        raise MalformedHeader(f"bad format version {version!r}")
    if int(match.group(1)) not in READABLE_MAJORS:
        raise UnsupportedVersion(
            f"chunk format version {version} is not supported (this reader knows major "
            f"{', '.join(str(m) for m in sorted(READABLE_MAJORS))}); upgrade chunkstore"
        )
    fingerprint = _hex_field(meta, "fingerprint", 64)
    namespace_bytes = _hex_field(meta, "namespace", 16)
    key = _hex_field(meta, "key", 64)
    parent = _hex_field(meta, "parent", 64)
    tokens_text = meta.get("tokens")
    if (
        not isinstance(tokens_text, str)
        or len(tokens_text) % 8
        or not _HEX.fullmatch(tokens_text.encode())
    ):
        raise MalformedHeader("header field 'tokens' must be 8 hex digits per token")
    token_bytes = bytes.fromhex(tokens_text)
    compression = meta.get("compression")
    if compression not in COMPRESSIONS:
        raise MalformedHeader(f"unknown compression {compression!r}")
    payload_size = _int_field(meta, "payload_size")
    stored_size = _int_field(meta, "stored_size")
    if compression == "none" and stored_size != payload_size:
        raise MalformedHeader("uncompressed chunk with stored_size != payload_size")
    checksum = _hex_field(meta, "checksum", 32, f"{CHECKSUM_ALGORITHM}:")
    checksum_marker = f'"checksum":"{CHECKSUM_ALGORITHM}:'.encode()
    checksum_span = _span(raw, checksum_marker, 32)
    mac = None
    mac_span = None
    if "mac" in meta:
        mac = _hex_field(meta, "mac", 64, f"{MAC_ALGORITHM}:")
        mac_span = _span(raw, f'"mac":"{MAC_ALGORITHM}:'.encode(), 64)

    entries: list[TensorEntry] = []
    for name, entry in document.items():
        if not isinstance(entry, dict):
            raise MalformedHeader(f"tensor {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or not is_known_dtype(dtype):
            raise MalformedHeader(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise MalformedHeader(f"tensor {name!r} has a bad shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise MalformedHeader(f"tensor {name!r} has bad data_offsets")
        begin, end = offsets
        nbytes = dtype_named(dtype).itemsize
        for d in shape:
            nbytes *= d
        if begin < 0 or end - begin != nbytes:
            raise LayoutError(f"tensor {name!r}: offsets {offsets} do not fit shape and dtype")
        entries.append(TensorEntry(name, dtype, tuple(shape), begin, nbytes))
    entries.sort(key=lambda e: (e.offset, e.nbytes))
    cursor = 0
    for entry in entries:
        if entry.offset != cursor:
            kind = "overlap" if entry.offset < cursor else "hole"
            raise LayoutError(
                f"tensor {entry.name!r} at {entry.offset}: {kind} before it (at {cursor})"
            )
        cursor = entry.offset + entry.nbytes
    if cursor != payload_size:
        raise LayoutError(f"tensors cover {cursor} bytes, payload_size says {payload_size}")
    return ChunkHeader(
        version=version,
        fingerprint=fingerprint,
        namespace=namespace_bytes.hex(),
        key=key,
        parent=parent,
        token_bytes=token_bytes,
        compression=compression,
        payload_size=payload_size,
        stored_size=stored_size,
        checksum=checksum,
        mac=mac,
        tensors=tuple(entries),
        data_offset=data_offset,
        checksum_span=checksum_span,
        mac_span=mac_span,
    )
