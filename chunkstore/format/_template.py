"""Header templates: how headers are written, and how known ones are read by position.

Every field of an uncompressed chunk has a fixed width: hex digests, 8 hex digits per token.
So one template per spec is rendered, and each chunk's header overwrites its byte ranges.
No JSON is encoded per chunk.
A header whose fixed bytes match a known template is read at known positions, without JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from chunkstore.errors import MalformedHeader
from chunkstore.format._headertypes import (
    _LEN,
    CHECKSUM_ALGORITHM,
    FORMAT_VERSION,
    MAC_ALGORITHM,
    ChunkHeader,
    TensorEntry,
    _unhex,
)


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
        remember: bool = True,
    ) -> HeaderTemplate:
        """Render the header of an uncompressed chunk with zeroed digests and tokens.

        ``remember``: let :func:`parse_header` read headers of this shape by position."""
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
        if remember:
            _remember(template)
        return template


# Templates of the layouts this process has built, by header length, each with its fixed bytes
# (everything between its variable fields, as (start, bytes) pieces). Decoding a chunk whose
# fixed bytes equal a known template skips JSON parsing: the fields are read at known
# positions. Anything else takes the general JSON path, so foreign writers still work.
_KNOWN_TEMPLATES: dict[int, list[tuple[HeaderTemplate, tuple[tuple[int, bytes], ...]]]] = {}
_MAX_TEMPLATES_PER_LENGTH = 8


def _remember(template: HeaderTemplate) -> None:
    bucket = _KNOWN_TEMPLATES.setdefault(len(template.raw), [])
    if all(known != template for known, _ in bucket):
        bucket.insert(0, (template, _fixed_spans(template)))
        del bucket[_MAX_TEMPLATES_PER_LENGTH:]


_UNLEARNABLE: set[tuple[int, tuple[TensorEntry, ...], bool, int]] = set()
"""Header shapes :func:`_learn` found this library renders differently (bounded)."""
_MAX_UNLEARNABLE = 64


def _fixed_spans(template: HeaderTemplate) -> tuple[tuple[int, bytes], ...]:
    """The template's bytes between its variable fields: (start, bytes) per piece."""
    spans = []
    cursor = 0
    for start, stop in sorted(template.positions.values()):
        spans.append((cursor, start))
        cursor = stop
    spans.append((cursor, len(template.raw)))
    return tuple((start, template.raw[start:stop]) for start, stop in spans if stop > start)


def _learn(raw: bytes, header: ChunkHeader) -> None:
    """Remember the template of a header the JSON parser accepted.

    Only if this library renders headers of its shape byte for byte the same.
    A reader process that never built the layout then parses later chunks of it by position.
    This is safe for every later input.
    One that matches the template's fixed bytes differs from ``raw`` only in the hex fields.
    Those have fixed widths, and both parsers check them alike.
    So the JSON parser would accept it and return the same fields.
    """
    from chunkstore.format._layout import ALIGNMENT  # layout builds on this module

    dtypes = {entry.dtype for entry in header.tensors}
    if header.compression != "none" or header.version != FORMAT_VERSION or len(dtypes) != 1:
        return
    shape = (len(raw), header.tensors, header.mac is not None, len(header.token_bytes))
    if shape in _UNLEARNABLE:
        return  # a foreign writer's header: not rendered again for every chunk
    template = HeaderTemplate.build(
        dtype=dtypes.pop(),
        chunk_tokens=len(header.token_bytes) // 4,
        tensors=[(e.name, e.shape, e.offset, e.nbytes) for e in header.tensors],
        payload_size=header.payload_size,
        authenticated=header.mac is not None,
        alignment=ALIGNMENT,
        remember=False,
    )
    skeleton = bytearray(raw)
    if len(template.raw) == len(raw):
        for start, stop in template.positions.values():
            skeleton[start:stop] = b"0" * (stop - start)
    if skeleton == template.raw:
        _remember(template)
        return
    if len(_UNLEARNABLE) >= _MAX_UNLEARNABLE:
        _UNLEARNABLE.clear()
    _UNLEARNABLE.add(shape)


def _parse_known(raw: bytes) -> ChunkHeader | None:
    """Parse ``raw`` by position if its fixed bytes match a known template, else None.

    This runs once per chunk read.
    Only the fixed pieces are compared, with ``startswith`` at their offsets.
    No slice of the header is copied.
    Each variable field is checked and decoded with one C-level pass.
    ``binascii`` takes the bytes as they are.
    ``bytes.fromhex`` would need a str.
    Decoding the 2 KiB token field to one cost more than the rest of the parse.
    """
    template = _known_template(raw)
    return None if template is None else _known_fields(raw, template)


def _known_template(raw: bytes) -> HeaderTemplate | None:
    """The known template whose fixed bytes ``raw`` holds, compared with ``startswith``
    at their offsets; None if none does."""
    for template, pieces in _KNOWN_TEMPLATES.get(len(raw), ()):
        for start, piece in pieces:
            if not raw.startswith(piece, start):
                break
        else:
            return template
    return None


def _known_link(raw: bytes) -> bytes | None:
    """The parent digest and token bytes of ``raw``, read by position as
    :func:`_parse_known` reads them, the rest left unparsed; None if no known template
    matches or either field is not lower-case hex."""
    template = _known_template(raw)
    if template is None:
        return None
    parent = _unhex(raw[slice(*template.positions["parent"])])
    tokens = _unhex(raw[slice(*template.positions["tokens"])])
    return None if parent is None or tokens is None else parent + tokens


def _known_fields(raw: bytes, template: HeaderTemplate) -> ChunkHeader:
    """The header ``raw`` holds, whose fixed bytes are ``template``'s."""
    values: dict[str, bytes] = {}
    for name, (start, stop) in template.positions.items():
        value = _unhex(raw[start:stop])
        if value is None:
            raise MalformedHeader(f"header field {name!r} must be lower-case hex digits")
        values[name] = value
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
