"""Encoding and decoding whole chunks, as spec/FORMAT.md defines them.

Write path: fill the payload of a buffer of ``layout.total_size`` bytes.
Use one :meth:`ChunkLayout.write_shard` per TP rank, or :func:`encode_chunk` for whole tensors.
Then :func:`seal_chunk` renders the header and checksum in place.
Read path: :func:`decode_chunk` validates and returns views into the input.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import xxhash

from chunkstore.errors import (
    AuthenticationError,
    ChecksumMismatch,
    CompressionError,
    ConfigError,
    FormatError,
    KeyMismatch,
    LayoutError,
    MissingDependency,
    SpecMismatch,
    TruncatedChunk,
    UnsupportedVersion,
)
from chunkstore.format._dtypes import dtype_named
from chunkstore.format._header import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    ChunkHeader,
    _meta_fields,
    complete_header,
    open_header,
    parse_header,
    render_header,
)
from chunkstore.format._layout import ALIGNMENT, ChunkLayout
from chunkstore.format._template import _known_link

if TYPE_CHECKING:
    import numpy as np

_MAC_CONTEXT = "chunkstore 2026-11 chunk mac key v1"
_ZERO_HEX = b"0" * 64
_FUSED_BLOCK = 256 * 1024
"""Bytes hashed then copied at a time in fused loops: well inside a core's L2."""


def mac_key_from_secret(secret: bytes | str) -> bytes:
    """Derive the 32-byte MAC key from a shared secret of any length (BLAKE3 derive_key)."""
    material = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not material:
        raise ConfigError("the chunk authentication secret must not be empty")
    return blake3.blake3(material, derive_key_context=_MAC_CONTEXT).digest()


def _zeroed(head: bytes | bytearray | memoryview, *spans: tuple[int, int] | None) -> bytes:
    out = bytearray(head)
    for span in spans:
        if span is not None:
            out[span[0] : span[1]] = _ZERO_HEX[: span[1] - span[0]]
    return bytes(out)


def _checksum(head_zeroed: bytes, payload: Any) -> bytes:
    hasher = xxhash.xxh3_128()
    hasher.update(head_zeroed)
    hasher.update(payload)
    return hasher.digest()


def _mac(mac_key: bytes, head_zeroed: bytes, payload: Any) -> bytes:
    hasher = blake3.blake3(key=mac_key)
    hasher.update(head_zeroed)
    hasher.update(payload)
    return hasher.digest()


def key_digest(parent: bytes, tokens: Any) -> bytes:
    """BLAKE3(parent || tokens as little-endian uint32): the key a chunk must carry.

    ``tokens`` is a sequence of ids or, already encoded, little-endian uint32 bytes.
    """
    import numpy as np

    hasher = blake3.blake3(bytes(parent))
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        hasher.update(tokens)
    else:
        hasher.update(np.ascontiguousarray(tokens, dtype="<u4").tobytes())
    return hasher.digest()


def _render_head(
    layout: ChunkLayout, *, key: bytes, parent: bytes, namespace: str, tokens: Any, verify_key: bool
) -> bytearray:
    """The header with every field filled in except MAC and checksum (left zeroed)."""
    import numpy as np

    token_array = np.ascontiguousarray(tokens, dtype="<u4")
    if token_array.shape != (layout.spec.chunk_tokens,):
        raise ConfigError(
            f"a chunk covers {layout.spec.chunk_tokens} tokens, got {token_array.size}"
        )
    if verify_key and key_digest(parent, token_array) != bytes(key):
        raise KeyMismatch("key is not BLAKE3(parent || tokens)")
    template = layout.template
    head = bytearray(template.raw)
    values = {
        "fingerprint": layout.fingerprint.hex(),
        "namespace": namespace,
        "key": bytes(key).hex(),
        "parent": bytes(parent).hex(),
        "tokens": token_array.tobytes().hex(),
    }
    for name, text in values.items():
        start, stop = template.positions[name]
        encoded = text.encode()
        if len(encoded) != stop - start:
            raise ConfigError(f"{name} has the wrong width for the header ({len(encoded)})")
        head[start:stop] = encoded
    return head


def _finish_head(
    layout: ChunkLayout,
    view: memoryview,
    head: bytearray,
    checksum: bytes | None,
    mac_key: bytes | None,
) -> None:
    """Add MAC and checksum to ``head`` and write it in front of the payload in ``view``.

    ``checksum`` may be precomputed, fused with the payload copy.
    That is allowed only when no MAC is added, since the checksum covers the MAC field.
    """
    payload = view[layout.data_offset :]
    positions = layout.template.positions
    if mac_key is not None:
        start, stop = positions["mac"]
        head[start:stop] = _mac(mac_key, bytes(head), payload).hex().encode()
        checksum = None
    if checksum is None:
        checksum = _checksum(bytes(head), payload)
    start, stop = positions["checksum"]
    head[start:stop] = checksum.hex().encode()
    view[: layout.data_offset] = head


def _check_seal_args(layout: ChunkLayout, view: memoryview, mac_key: bytes | None) -> None:
    if len(view) != layout.total_size:
        raise ConfigError(f"chunk buffer has {len(view)} bytes, layout needs {layout.total_size}")
    if (mac_key is not None) != layout.authenticated:
        raise ConfigError("pass mac_key exactly when the layout is authenticated")


def seal_chunk(
    layout: ChunkLayout,
    buf: Any,
    *,
    key: bytes,
    parent: bytes,
    namespace: str,
    tokens: Any,
    mac_key: bytes | None = None,
    verify_key: bool = True,
) -> None:
    """Write header, (MAC) and checksum into ``buf`` whose payload is already filled.

    ``buf`` is a writable buffer of ``layout.total_size`` bytes (a host-pool
    slot, a bytearray). After this call it holds a complete, valid chunk.
    """
    view = memoryview(buf).cast("B")
    _check_seal_args(layout, view, mac_key)
    head = _render_head(
        layout, key=key, parent=parent, namespace=namespace, tokens=tokens, verify_key=verify_key
    )
    _finish_head(layout, view, head, None, mac_key)


def encode_chunk(
    layout: ChunkLayout,
    *,
    key: bytes,
    parent: bytes,
    namespace: str,
    tokens: Any,
    tensors: Mapping[str, Any],
    out: Any | None = None,
    mac_key: bytes | None = None,
    compression: str = "none",
) -> Any:
    """Encode whole tensors, every head, as one chunk. Returns ``out`` or a new bytearray.

    The checksum is computed tensor by tensor right after each copy.
    The bytes are then still in cache, so no second pass over the payload is needed.
    With ``compression="zstd"`` the result is a new ``bytes``, and ``out`` must be None.
    That result is not safetensors-readable, and is smaller on cold tiers.
    """
    import numpy as np

    if compression != "none" and out is not None:
        raise ConfigError("compressed chunks cannot be encoded into a caller buffer")
    buf = bytearray(layout.total_size) if out is None else out
    view = memoryview(buf).cast("B")
    _check_seal_args(layout, view, mac_key)
    head = _render_head(
        layout, key=key, parent=parent, namespace=namespace, tokens=tokens, verify_key=True
    )
    hasher = xxhash.xxh3_128()
    hasher.update(bytes(head))
    for slot in layout.tensors:
        if slot.name not in tensors:
            raise LayoutError(f"tensors lack {slot.name}")
        target = layout.tensor_view(view, slot.name)
        source = np.asarray(tensors[slot.name])
        if source.shape != target.shape or source.nbytes != target.nbytes:
            raise LayoutError(f"{slot.name}: shape {source.shape}, expected {target.shape}")
        np.copyto(target, source if source.dtype == target.dtype else source.view(target.dtype))
        start = layout.data_offset + slot.offset
        hasher.update(view[start : start + slot.nbytes])
    _finish_head(layout, view, head, hasher.digest(), mac_key)
    if compression == "none":
        return buf
    return recompress(buf, compression, mac_key=mac_key)


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise MissingDependency(
            "zstd compression needs the zstandard package: pip install 'chunkstore[zstd]'"
        ) from None
    return zstandard


_ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"


_ZSTD_MAX_BLOCK = 128 * 1024
"""Block_Maximum_Size (RFC 8878 section 3.1.1.2.3): no block decompresses to more."""


def _zstd_frame_extent(zstd: Any, stored: memoryview) -> tuple[int, int]:
    """Bytes the zstd frame at the start of ``stored`` spans, and the most its blocks give.

    It walks the frame's block headers, see RFC 8878 section 3.1.1.2.
    The decompressor itself ignores whatever follows a frame.
    It allocates the content size the frame header declares, before it finds the blocks
    hold less."""
    position = int(zstd.frame_header_size(stored))
    most = 0
    while True:
        if position + 3 > len(stored):
            raise CompressionError("zstd frame is truncated")
        block = int.from_bytes(stored[position : position + 3], "little")
        block_type, block_size = (block >> 1) & 3, block >> 3
        if block_type == 3:
            raise CompressionError("zstd frame has a reserved block type")
        position += 3 + (1 if block_type == 1 else block_size)  # an RLE block stores one byte
        most += _ZSTD_MAX_BLOCK if block_type == 2 else block_size  # raw, RLE: Block_Size
        if block & 1:  # Last_Block
            return position + 4, most  # the content checksum (required, checked before)


def _unzstd(stored: memoryview, payload_size: int) -> bytes:
    """The payload of a ``zstd`` chunk, see spec section 4.4. Raises :class:`CompressionError`.

    The stored payload must be exactly one zstd frame.
    No skippable frames are allowed, and nothing after it.
    The frame carries a content checksum and declares ``payload_size`` as its content size.
    So every reader allocates the same bounded output and checks the same digest.
    """
    zstd = _zstd()
    if bytes(stored[:4]) != _ZSTD_FRAME_MAGIC:
        raise CompressionError("stored payload does not start with a zstd frame")
    try:
        params = zstd.get_frame_parameters(stored)
    except zstd.ZstdError as exc:
        raise CompressionError(f"zstd frame header is invalid: {exc}") from None
    if not params.has_checksum:
        raise CompressionError("zstd frame carries no content checksum (section 4.4 needs one)")
    if params.content_size == zstd.CONTENTSIZE_UNKNOWN:
        raise CompressionError("zstd frame declares no content size (section 4.4 needs one)")
    if params.content_size != payload_size:
        raise CompressionError(
            f"zstd frame declares {params.content_size} content bytes, payload_size {payload_size}"
        )
    frame_size, most = _zstd_frame_extent(zstd, stored)
    if frame_size != len(stored):
        raise CompressionError("stored payload must be exactly one zstd frame, nothing after it")
    if payload_size > most:
        # refused before the decompressor allocates payload_size bytes (a 4 KiB chunk
        # declaring 10**17 bytes was a MemoryError, not a verdict)
        raise CompressionError(
            f"zstd frame declares {payload_size} content bytes, its blocks hold at most {most}"
        )
    try:
        payload: bytes = zstd.ZstdDecompressor().decompress(stored, max_output_size=payload_size)
    except zstd.ZstdError as exc:
        raise CompressionError(f"zstd payload cannot be decompressed: {exc}") from None
    if len(payload) != payload_size:
        raise CompressionError("decompressed payload has the wrong size")
    return payload


def recompress(
    data: Any, compression: str, *, mac_key: bytes | None = None, verify: bool = True
) -> bytes:
    """Re-encode a valid chunk with another payload compression, ``none`` or ``zstd``.

    ``verify=False`` skips the checksum of ``data``, for bytes a verifying store just checked.
    A zstd payload is still decompressed under its frame's content checksum and size.
    The new chunk's checksum is computed over the payload it holds.
    """
    chunk = decode_chunk(data, mac_key=mac_key, verify=verify)
    header = chunk.header
    if compression == header.compression:
        return bytes(memoryview(data).cast("B"))
    payload = chunk.payload
    if compression == "zstd":
        stored: Any = _zstd().ZstdCompressor(level=3, write_checksum=True).compress(payload)
    elif compression == "none":
        stored = payload
    else:
        raise ConfigError(f"unknown compression {compression!r}; use 'none' or 'zstd'")
    meta = _meta_fields(
        version=FORMAT_VERSION,
        fingerprint=header.fingerprint.hex(),
        namespace=header.namespace,
        key=header.key.hex(),
        parent=header.parent.hex(),
        tokens=header.token_bytes.hex(),
        compression=compression,
        payload_size=header.payload_size,
        stored_size=len(stored),
        mac="0" * 64 if mac_key is not None else None,
        checksum="0" * 32,
    )
    tensors = [(t.name, t.dtype, t.shape, t.offset, t.nbytes) for t in header.tensors]
    head = bytearray(render_header(meta, tensors, ALIGNMENT))
    parsed = parse_header(memoryview(bytes(head)))
    if mac_key is not None and parsed.mac_span is not None:
        start, stop = parsed.mac_span
        head[start:stop] = _mac(mac_key, bytes(head), stored).hex().encode()
    start, stop = parsed.checksum_span
    head[start:stop] = _checksum(bytes(head), stored).hex().encode()
    return bytes(head) + bytes(stored)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A decoded chunk: its validated header and a view of its (uncompressed) payload."""

    header: ChunkHeader
    """The parsed header."""
    payload: memoryview
    """Payload bytes (a view into the input when uncompressed)."""

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of tensor ``name`` (no copy for uncompressed chunks)."""
        import numpy as np

        for entry in self.header.tensors:
            if entry.name == name:
                flat = np.frombuffer(self.payload, np.uint8, entry.nbytes, entry.offset)
                return flat.view(dtype_named(entry.dtype).numpy).reshape(entry.shape)
        raise KeyError(name)

    def tensors(self) -> dict[str, np.ndarray]:
        """Every tensor, as views, in payload order."""
        return {entry.name: self.tensor(entry.name) for entry in self.header.tensors}

    def copy_into(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Copy tensors into caller-provided arrays of matching shape (one copy, no temporaries)."""
        import numpy as np

        for name, target in arrays.items():
            source = self.tensor(name)
            if target.shape != source.shape or target.nbytes != source.nbytes:
                raise LayoutError(f"{name}: target {target.shape} does not match {source.shape}")
            np.copyto(target, source if target.dtype == source.dtype else source.view(target.dtype))


def decode_chunk(
    data: Any,
    *,
    verify: bool = True,
    mac_key: bytes | None = None,
    expected_key: bytes | None = None,
    expected_fingerprint: bytes | None = None,
    expected_namespace: str | None = None,
) -> Chunk:
    """Validate ``data`` and return views into it.

    ``data`` is bytes, a bytearray, a memoryview or an mmap.
    ``verify=False`` skips the checksum, for bytes that never left trusted host memory.
    Structure, key derivation and MAC are always checked.
    Every defect raises a :class:`~chunkstore.errors.FormatError` subclass.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    # Spec section 3.4: what major 1 freezes first, then the stored length, checksum and MAC,
    # and only then what a newer minor may add. So a damaged chunk is corrupt even where it
    # also names a compression, dtype or role this reader lacks (it is not left in place).
    opened = open_header(view)
    stored = view[opened.data_offset :]
    if len(stored) < opened.stored_size:
        raise TruncatedChunk(f"payload has {len(stored)} of {opened.stored_size} bytes")
    if len(stored) > opened.stored_size:
        raise LayoutError(f"{len(stored) - opened.stored_size} trailing bytes after the payload")
    if verify or mac_key is not None:
        head = bytes(view[: opened.data_offset])
        if verify and _checksum(_zeroed(head, opened.checksum_span), stored) != opened.checksum:
            raise ChecksumMismatch(f"chunk {opened.key.hex()} failed its xxh3-128 checksum")
        if mac_key is not None:
            if opened.mac is None:
                raise AuthenticationError("chunk carries no MAC but the reader requires one")
            expected = _mac(mac_key, _zeroed(head, opened.checksum_span, opened.mac_span), stored)
            if expected != opened.mac:
                raise AuthenticationError(f"chunk {opened.key.hex()} has an invalid MAC")
    header = complete_header(opened)
    check_identity(header, expected_key, expected_fingerprint, expected_namespace)
    if header.compression == "zstd":
        payload = _unzstd(stored, header.payload_size)
        return Chunk(header, memoryview(payload))
    return Chunk(header, stored)


class PayloadVerifier:
    """Streaming check of an uncompressed chunk whose header is already parsed.

    It is for readers that copy the payload block by block, from a file or a socket.
    They hash each block while it is still in cache.
    Construct it with the header and the header bytes.
    Key derivation and identity are checked here.
    Call :meth:`update` with the stored payload in order, then :meth:`finish`.
    :meth:`finish` raises :class:`ChecksumMismatch` exactly when :func:`decode_chunk` would.
    """

    __slots__ = ("_hasher", "header", "update")

    update: Callable[[Any], None]
    """Hash the next bytes of the stored payload.
    It is the hasher's own method.
    A reader calls it once per block, so no Python frame stands between it and the C hash."""

    def __init__(
        self,
        header: ChunkHeader,
        head: Any,
        *,
        expected_key: bytes | None = None,
        expected_fingerprint: bytes | None = None,
        expected_namespace: str | None = None,
    ) -> None:
        if header.compression != "none":
            raise ConfigError("streaming verification covers uncompressed chunks only")
        check_identity(header, expected_key, expected_fingerprint, expected_namespace)
        self.header = header
        hasher = xxhash.xxh3_128()
        # The header with its checksum digits zeroed, hashed in three pieces straight from
        # ``head`` (no copy of the header: this runs once per chunk read).
        view = memoryview(head).cast("B")
        start, stop = header.checksum_span
        hasher.update(view[:start])
        hasher.update(_ZERO_HEX[: stop - start])
        hasher.update(view[stop : header.data_offset])
        self._hasher = hasher
        self.update = hasher.update

    def finish(self) -> None:
        """Raise :class:`ChecksumMismatch` unless the payload fed so far matches the header."""
        if self._hasher.digest() != self.header.checksum:
            raise ChecksumMismatch(f"chunk {self.header.key.hex()} failed its xxh3-128 checksum")


def decode_into(
    data: Any,
    arrays: Mapping[str, np.ndarray],
    *,
    verify: bool = True,
    mac_key: bytes | None = None,
    expected_key: bytes | None = None,
    expected_fingerprint: bytes | None = None,
    expected_namespace: str | None = None,
) -> ChunkHeader:
    """Validate ``data`` and copy its tensors into caller-provided ``arrays`` in one pass.

    Checksum and copy are fused tensor by tensor (each tensor is hashed, then
    copied while still in cache). On :class:`ChecksumMismatch` the arrays may
    already hold damaged bytes: treat them as garbage, like any miss.
    """
    import numpy as np

    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    try:
        header = parse_header(view)
    except UnsupportedVersion:
        # From the header alone; the full check calls a damaged chunk corrupt instead.
        decode_chunk(view, verify=verify, mac_key=mac_key)
        raise
    if header.compression != "none" or mac_key is not None:
        chunk = decode_chunk(
            view,
            verify=verify,
            mac_key=mac_key,
            expected_key=expected_key,
            expected_fingerprint=expected_fingerprint,
            expected_namespace=expected_namespace,
        )
        chunk.copy_into(arrays)
        return chunk.header
    stored = view[header.data_offset :]
    if len(stored) != header.stored_size:
        error = TruncatedChunk if len(stored) < header.stored_size else LayoutError
        raise error(f"payload has {len(stored)} bytes, header says {header.stored_size}")
    if verify:
        verifier: PayloadVerifier | None = PayloadVerifier(
            header,
            view,
            expected_key=expected_key,
            expected_fingerprint=expected_fingerprint,
            expected_namespace=expected_namespace,
        )
    else:
        verifier = None
        check_identity(header, expected_key, expected_fingerprint, expected_namespace)
    for entry in header.tensors:
        target = arrays.get(entry.name)
        if target is not None and (target.shape != entry.shape or target.nbytes != entry.nbytes):
            raise LayoutError(f"{entry.name}: target {target.shape} does not match {entry.shape}")
        # Hash and copy in blocks small enough to stay in L2 between the two passes.
        flat_target = target.reshape(-1).view(np.uint8) if target is not None else None
        for start in range(0, entry.nbytes, _FUSED_BLOCK):
            stop = min(start + _FUSED_BLOCK, entry.nbytes)
            segment = stored[entry.offset + start : entry.offset + stop]
            if verifier is not None:
                verifier.update(segment)
            if flat_target is not None:
                flat_target[start:stop] = np.frombuffer(segment, np.uint8)
    if verifier is not None:
        verifier.finish()
    return header


def check_identity(
    header: ChunkHeader,
    expected_key: bytes | None,
    expected_fingerprint: bytes | None,
    expected_namespace: str | None = None,
) -> None:
    """What a header alone says about a chunk's identity (spec section 4.3).

    Raises :class:`KeyMismatch` unless the key is BLAKE3(parent || tokens).
    It raises it too unless the key is ``expected_key``, if given.
    And unless the header's namespace is ``expected_namespace``, if given.
    That is the namespace the reader looked in.
    Raises :class:`SpecMismatch` unless the fingerprint is ``expected_fingerprint``, if given."""
    if key_digest(header.parent, header.token_bytes) != header.key:
        raise KeyMismatch(f"chunk {header.key.hex()} is not BLAKE3(parent || tokens)")
    if expected_key is not None and bytes(expected_key) != header.key:
        raise KeyMismatch(f"asked for {bytes(expected_key).hex()}, chunk holds {header.key.hex()}")
    if expected_namespace is not None and expected_namespace != header.namespace:
        raise KeyMismatch(
            f"asked in namespace {expected_namespace}, chunk names namespace {header.namespace}"
        )
    if expected_fingerprint is not None and bytes(expected_fingerprint) != header.fingerprint:
        raise SpecMismatch("chunk was written for another model fingerprint")


def read_header(data: Any) -> ChunkHeader:
    """Parse only the header (no checksum): for listing and inspection."""
    return parse_header(memoryview(data).cast("B"))


def chain_link(data: bytes | bytearray | memoryview) -> bytes | None:
    """What the key of the chunk at the start of ``data`` hashes: its parent digest
    followed by its tokens as little-endian uint32, as its header holds them (BLAKE3 of
    the result is the key's digest, when the header is honest). None where the header is
    not whole or not well formed. A header of a known layout is read by position."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        return None
    end = header_bytes_needed(view)
    if end - 8 > MAX_HEADER_BYTES or len(view) < end:
        return None
    link = _known_link(bytes(view[:end]))
    if link is not None:
        return link
    try:
        header = parse_header(view)
    except FormatError:
        return None
    return header.parent + header.token_bytes


def header_bytes_needed(prefix: bytes | bytearray | memoryview) -> int:
    """Given at least the first 8 bytes of a chunk, how many bytes its header spans."""
    if len(prefix) < 8:
        raise TruncatedChunk("need 8 bytes to read the header length")
    return 8 + int(struct.unpack_from("<Q", prefix, 0)[0])
