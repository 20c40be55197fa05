"""Wire format of the peer protocol in spec/PROTOCOL.md: framing, MACs, keys, validation.

A message is one ZeroMQ multipart message ``[body, tag, data...]``.
``body`` is a msgpack map.
``tag`` is the HMAC-SHA256 of the body, empty when no secret is configured.
``data`` is zero or more raw chunk files.
Nothing here touches a socket.
So the rules are testable without ZeroMQ, and server and client share them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import blake3

from chunkstore.errors import ConfigError, MissingDependency
from chunkstore.hashing import DIGEST_SIZE, ChunkKey, is_namespace
from chunkstore.peer._errors import ProtocolViolation
from chunkstore.units import shown

PROTOCOL_VERSION = 1
"""The major version this implementation writes."""
ACCEPTED_VERSIONS = frozenset({1})
"""Majors this implementation reads (a reader accepts a set, a writer emits one)."""

KEY_WIRE_BYTES = 40
"""A key on the wire: 8 namespace bytes || 32 digest bytes."""
TAG_BYTES = 32
SESSION_BYTES = 16
LEASE_BYTES = 16

# Bounds of the fields a server keeps or acts on (spec/PROTOCOL.md §4, "Field grammar").
MAX_CLIENT_NAME_BYTES = 256
"""Longest ``client`` name in ``hello``, in UTF-8 bytes. The server keeps it per session."""
MAX_HELLO_LIST = 16
"""Most entries of the ``versions`` and ``planes`` lists of ``hello``."""
MAX_PLANE_NAME_CHARS = 32
"""Longest data plane name."""
MAX_NIXL_METADATA_BYTES = 64 << 10
"""Largest ``nixl_md`` (a client's NIXL agent metadata) a server loads."""
MAX_CHUNK_TOKENS = (1 << 31) - 1
"""Largest ``chunk_tokens``."""
MAX_ADDRESS = (1 << 64) - 1
"""Largest memory address in ``addrs``."""
MAX_TP = 64
"""Most TP ranks of one engine assembling a chunk through a node service."""
MAX_CHUNK_TOKENS_ON_WIRE = 1 << 20
"""Most token ids of one chunk in a ``reserve`` (4 MiB)."""
MAX_ENGINE_ID_BYTES = 64
"""Longest ``engine`` identity in a TP rank's ``reserve``."""

_CONTROL_CONTEXT = "chunkstore 2026-11 peer control mac v1"
_DATA_CONTEXT = "chunkstore 2026-11 peer data mac v1"
_REQUEST_LABEL = b"chunkstore-peer v1 request\x00"
_REPLY_LABEL = b"chunkstore-peer v1 reply\x00"

SECRET_ENV = "CHUNKSTORE_PEER_SECRET"
"""Environment variable read when no secret is passed explicitly."""

# Error codes (spec/PROTOCOL.md, "Errors").
MALFORMED = "malformed"
TOO_LARGE = "too_large"
UNSUPPORTED_VERSION = "unsupported_version"
AUTH_FAILED = "auth_failed"
NO_SESSION = "no_session"
FINGERPRINT_MISMATCH = "fingerprint_mismatch"
CHUNK_TOKENS_MISMATCH = "chunk_tokens_mismatch"
UNKNOWN_OP = "unknown_op"
READ_ONLY = "read_only"
DATAPLANE_UNAVAILABLE = "dataplane_unavailable"
UNKNOWN_LEASE = "unknown_lease"
TOO_MANY_SESSIONS = "too_many_sessions"
GEOMETRY_MISMATCH = "geometry_mismatch"
INTERNAL = "internal"
ERROR_CODES = frozenset(
    {
        MALFORMED,
        TOO_LARGE,
        UNSUPPORTED_VERSION,
        AUTH_FAILED,
        NO_SESSION,
        FINGERPRINT_MISMATCH,
        CHUNK_TOKENS_MISMATCH,
        UNKNOWN_OP,
        READ_ONLY,
        DATAPLANE_UNAVAILABLE,
        UNKNOWN_LEASE,
        TOO_MANY_SESSIONS,
        GEOMETRY_MISMATCH,
        INTERNAL,
    }
)

PLANE_NIXL = "nixl"
PLANE_INLINE = "inline"
PLANE_SHM = "shm"
"""The node plane: client and server map one shared slot pool. Replies name slots."""
PLANES = (PLANE_NIXL, PLANE_INLINE, PLANE_SHM)
"""Every data plane this implementation knows."""


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:
        raise MissingDependency(
            "the peer store needs msgpack and pyzmq: pip install 'chunkstore[peer]'"
        ) from None
    return msgpack


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits a receiver enforces. Larger input is rejected and counted."""

    max_control_bytes: int = 1 << 20
    """Largest msgpack body accepted."""
    max_keys: int = 4096
    """Most keys one request may name."""
    max_frame_bytes: int = 512 << 20
    """Largest single data frame, one chunk file. It is also ZMQ_MAXMSGSIZE."""
    max_message_bytes: int = 2 << 30
    """Largest sum of data frames in one message."""

    def as_dict(self) -> dict[str, int]:
        """The limits as sent in ``hello`` replies."""
        return {
            "max_control_bytes": self.max_control_bytes,
            "max_keys": self.max_keys,
            "max_frame_bytes": self.max_frame_bytes,
            "max_message_bytes": self.max_message_bytes,
        }


def secret_from(secret: bytes | str | None, *, use_env: bool = True) -> bytes | None:
    """The shared secret: the argument, else ``$CHUNKSTORE_PEER_SECRET``, else ``None``."""
    if secret is None and use_env:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    material = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not material:
        raise ConfigError("the peer secret must not be empty (unset it to disable authentication)")
    return material


# --- keys --------------------------------------------------------------------------


def pack_keys(keys: Sequence[ChunkKey]) -> bytes:
    """Keys as the wire's fixed-width blob (40 bytes each)."""
    out = bytearray()
    for key in keys:
        out += bytes.fromhex(key.namespace)
        out += key.digest
    return bytes(out)


def unpack_keys(blob: Any, limits: Limits) -> list[ChunkKey]:
    """Parse a key blob. Raises :class:`ProtocolViolation` on a bad length or count."""
    if not isinstance(blob, bytes) or len(blob) % KEY_WIRE_BYTES:
        raise ProtocolViolation(MALFORMED, f"keys must be a multiple of {KEY_WIRE_BYTES} bytes")
    count = len(blob) // KEY_WIRE_BYTES
    if count > limits.max_keys:
        raise ProtocolViolation(TOO_LARGE, f"{count} keys exceed the limit of {limits.max_keys}")
    keys = []
    for i in range(count):
        part = blob[i * KEY_WIRE_BYTES : (i + 1) * KEY_WIRE_BYTES]
        keys.append(ChunkKey(part[8:], part[:8].hex()))
    return keys


# --- schema --------------------------------------------------------------------------

_INT = (int,)
_OPT_INT = (int, type(None))
_BYTES = (bytes,)
_OPT_BYTES = (bytes, type(None))
_STR = (str,)
_OPT_STR = (str, type(None))
_LIST = (list,)
_BOOL = (bool,)

#: Fields each request op requires (beyond v, op, id), and their msgpack types.
REQUEST_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {
        "versions": _LIST,
        "client": _STR,
        "fingerprint": _OPT_BYTES,
        "chunk_tokens": _OPT_INT,
        "planes": _LIST,
        "nixl_md": _OPT_BYTES,
    },
    "lookup": {"s": _BYTES, "keys": _BYTES},
    "exists": {"s": _BYTES, "keys": _BYTES},
    "fetch": {"s": _BYTES, "keys": _BYTES, "plane": _STR, "lease_ms": _INT},
    "release": {"s": _BYTES, "lease": _BYTES, "ack": _BOOL},
    "push": {
        "s": _BYTES,
        "keys": _BYTES,
        "sizes": _LIST,
        "plane": _STR,
        "addrs": _LIST,
        "mode": _STR,
    },
    "reserve": {"s": _BYTES, "keys": _BYTES, "plane": _STR, "mode": _STR},
    "commit": {"s": _BYTES, "lease": _BYTES, "sizes": _LIST},
    "delete": {"s": _BYTES, "keys": _BYTES},
    "list": {"s": _BYTES, "namespace": _OPT_STR, "after": _OPT_BYTES, "limit": _INT},
    "stats": {"s": _BYTES},
    "bye": {"s": _BYTES},
}
OPTIONAL_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "*": {"dmacs": _LIST},
    "fetch": {"use": _BOOL},
    "hello": {"slot_size": _INT},
    "reserve": {"tp": _INT, "rank": _INT, "parents": _BYTES, "tokens": _LIST, "engine": _BYTES},
}


def validate_request(body: Any, limits: Limits | None = None) -> dict[str, Any]:
    """Check a decoded request against the schema and the field grammar. Returns it.

    Raises :class:`ProtocolViolation`: ``malformed``, ``too_large``,
    ``unsupported_version`` or ``unknown_op``.
    Every field that names or sizes something is checked here, before a server acts on it.
    Such fields name a session, a lease, a namespace or a key.
    """
    if not isinstance(body, dict):
        raise ProtocolViolation(MALFORMED, "the body is not a map")
    version = body.get("v")
    if not is_wire_int(version):
        raise ProtocolViolation(MALFORMED, "missing protocol version 'v'")
    if version not in ACCEPTED_VERSIONS:
        raise ProtocolViolation(
            UNSUPPORTED_VERSION,
            f"protocol version {version} is not supported "
            f"(this peer speaks {sorted(ACCEPTED_VERSIONS)})",
        )
    if not is_wire_int(body.get("id")) or not isinstance(body.get("op"), str):
        raise ProtocolViolation(MALFORMED, "a request needs an integer 'id' and a string 'op'")
    op = body["op"]
    fields = REQUEST_FIELDS.get(op)
    if fields is None:
        raise ProtocolViolation(UNKNOWN_OP, f"unknown operation {shown(op)}")
    for name, types in fields.items():
        if name not in body:
            raise ProtocolViolation(MALFORMED, f"{op}: missing field {name!r}")
        value = body[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolViolation(MALFORMED, f"{op}: field {name!r} has the wrong type")
    optional = {**OPTIONAL_FIELDS["*"], **OPTIONAL_FIELDS.get(op, {})}
    for name, types in optional.items():
        if name not in body:
            continue
        value = body[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolViolation(MALFORMED, f"{op}: field {name!r} has the wrong type")
    limits = limits or Limits()
    for name in [*fields, *(n for n in optional if n in body)]:
        check = FIELD_GRAMMAR.get(name)
        if check is not None:
            check(op, body[name], limits)
    return body


def is_wire_int(value: Any) -> TypeGuard[int]:
    """An integer on the wire. Booleans are not integers, see spec §3.4."""
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(code: str, op: str, name: str, why: str) -> ProtocolViolation:
    return ProtocolViolation(code, f"{op}: field {name!r} {why}")


def _check_session(op: str, value: Any, limits: Limits) -> None:
    if len(value) != SESSION_BYTES:
        raise _fail(MALFORMED, op, "s", f"must be a {SESSION_BYTES}-byte session id")


def _check_lease(op: str, value: Any, limits: Limits) -> None:
    if len(value) != LEASE_BYTES:
        raise _fail(MALFORMED, op, "lease", f"must be a {LEASE_BYTES}-byte lease id")


def _check_keys(op: str, value: Any, limits: Limits) -> None:
    if len(value) % KEY_WIRE_BYTES:
        raise _fail(MALFORMED, op, "keys", f"must be a multiple of {KEY_WIRE_BYTES} bytes")
    if len(value) // KEY_WIRE_BYTES > limits.max_keys:
        raise _fail(TOO_LARGE, op, "keys", f"names more than {limits.max_keys} keys")


def _check_namespace(op: str, value: Any, limits: Limits) -> None:
    if value is not None and not is_namespace(value):
        raise _fail(MALFORMED, op, "namespace", "must be 16 lower-case hex digits")


def _check_after(op: str, value: Any, limits: Limits) -> None:
    if value is not None and len(value) != KEY_WIRE_BYTES:
        raise _fail(MALFORMED, op, "after", f"must be one {KEY_WIRE_BYTES}-byte wire key")


def _check_limit(op: str, value: Any, limits: Limits) -> None:
    if value < 1:
        raise _fail(MALFORMED, op, "limit", "must be at least 1")


def _check_lease_ms(op: str, value: Any, limits: Limits) -> None:
    if value < 0:
        raise _fail(MALFORMED, op, "lease_ms", "must not be negative")


def _check_plane(op: str, value: Any, limits: Limits) -> None:
    if len(value) > MAX_PLANE_NAME_CHARS:
        raise _fail(TOO_LARGE, op, "plane", f"is longer than {MAX_PLANE_NAME_CHARS} characters")


def _check_mode(op: str, value: Any, limits: Limits) -> None:
    if value not in ("overwrite", "if_absent"):
        raise _fail(MALFORMED, op, "mode", "must be 'overwrite' or 'if_absent'")


def _check_sizes(op: str, value: Any, limits: Limits) -> None:
    if len(value) > limits.max_keys:
        raise _fail(TOO_LARGE, op, "sizes", f"has more than {limits.max_keys} entries")
    if not all(is_wire_int(size) and size >= 0 for size in value):
        raise _fail(MALFORMED, op, "sizes", "must hold non-negative integers")
    if any(size > limits.max_frame_bytes for size in value):
        raise _fail(TOO_LARGE, op, "sizes", "names a chunk larger than the frame limit")


def _check_addrs(op: str, value: Any, limits: Limits) -> None:
    if len(value) > limits.max_keys:
        raise _fail(TOO_LARGE, op, "addrs", f"has more than {limits.max_keys} entries")
    if not all(is_wire_int(a) and 0 < a <= MAX_ADDRESS for a in value):
        raise _fail(MALFORMED, op, "addrs", "must hold memory addresses")


def _check_versions(op: str, value: Any, limits: Limits) -> None:
    if len(value) > MAX_HELLO_LIST:
        raise _fail(TOO_LARGE, op, "versions", f"has more than {MAX_HELLO_LIST} entries")
    if not all(is_wire_int(v) for v in value):
        raise _fail(MALFORMED, op, "versions", "must hold integers")


def _check_planes(op: str, value: Any, limits: Limits) -> None:
    if len(value) > MAX_HELLO_LIST:
        raise _fail(TOO_LARGE, op, "planes", f"has more than {MAX_HELLO_LIST} entries")
    if not all(isinstance(p, str) and len(p) <= MAX_PLANE_NAME_CHARS for p in value):
        raise _fail(
            MALFORMED, op, "planes", f"must hold names of at most {MAX_PLANE_NAME_CHARS} characters"
        )


def _check_client(op: str, value: Any, limits: Limits) -> None:
    if len(value.encode("utf-8", "surrogatepass")) > MAX_CLIENT_NAME_BYTES:
        raise _fail(TOO_LARGE, op, "client", f"is longer than {MAX_CLIENT_NAME_BYTES} bytes")


def _check_fingerprint(op: str, value: Any, limits: Limits) -> None:
    if value is not None and len(value) != DIGEST_SIZE:
        raise _fail(MALFORMED, op, "fingerprint", f"must be {DIGEST_SIZE} bytes")


def _check_chunk_tokens(op: str, value: Any, limits: Limits) -> None:
    if value is not None and not 1 <= value <= MAX_CHUNK_TOKENS:
        raise _fail(MALFORMED, op, "chunk_tokens", f"must be 1..{MAX_CHUNK_TOKENS}")


def _check_slot_size(op: str, value: Any, limits: Limits) -> None:
    if not 1 <= value <= limits.max_frame_bytes:
        raise _fail(MALFORMED, op, "slot_size", f"must be 1..{limits.max_frame_bytes}")


def _check_tp(op: str, value: Any, limits: Limits) -> None:
    if not 1 <= value <= MAX_TP:
        raise _fail(MALFORMED, op, "tp", f"must be 1..{MAX_TP}")


def _check_rank(op: str, value: Any, limits: Limits) -> None:
    if not 0 <= value < MAX_TP:
        raise _fail(MALFORMED, op, "rank", f"must be 0..{MAX_TP - 1}")


def _check_parents(op: str, value: Any, limits: Limits) -> None:
    if len(value) % DIGEST_SIZE or len(value) // DIGEST_SIZE > limits.max_keys:
        raise _fail(MALFORMED, op, "parents", f"must be up to max_keys {DIGEST_SIZE}-byte digests")


def _check_tokens(op: str, value: Any, limits: Limits) -> None:
    if len(value) > limits.max_keys:
        raise _fail(TOO_LARGE, op, "tokens", f"has more than {limits.max_keys} entries")
    if not all(isinstance(t, bytes) and len(t) % 4 == 0 for t in value):
        raise _fail(MALFORMED, op, "tokens", "must hold little-endian uint32 token ids")
    if any(len(t) > 4 * MAX_CHUNK_TOKENS_ON_WIRE for t in value):
        raise _fail(TOO_LARGE, op, "tokens", "names a chunk of too many tokens")


def _check_engine(op: str, value: Any, limits: Limits) -> None:
    if not 1 <= len(value) <= MAX_ENGINE_ID_BYTES:
        raise _fail(MALFORMED, op, "engine", f"must be 1..{MAX_ENGINE_ID_BYTES} bytes")


def _check_nixl_md(op: str, value: Any, limits: Limits) -> None:
    if value is not None and len(value) > MAX_NIXL_METADATA_BYTES:
        raise _fail(TOO_LARGE, op, "nixl_md", f"is larger than {MAX_NIXL_METADATA_BYTES} bytes")


#: Per field name: the grammar check run after the type check (spec §4, "Field grammar").
FIELD_GRAMMAR: dict[str, Callable[[str, Any, Limits], None]] = {
    "s": _check_session,
    "lease": _check_lease,
    "keys": _check_keys,
    "namespace": _check_namespace,
    "after": _check_after,
    "limit": _check_limit,
    "lease_ms": _check_lease_ms,
    "plane": _check_plane,
    "mode": _check_mode,
    "sizes": _check_sizes,
    "addrs": _check_addrs,
    "versions": _check_versions,
    "planes": _check_planes,
    "client": _check_client,
    "fingerprint": _check_fingerprint,
    "chunk_tokens": _check_chunk_tokens,
    "nixl_md": _check_nixl_md,
    "slot_size": _check_slot_size,
    "tp": _check_tp,
    "rank": _check_rank,
    "parents": _check_parents,
    "tokens": _check_tokens,
    "engine": _check_engine,
}


# --- framing and MACs --------------------------------------------------------------


class Codec:
    """Encodes and decodes messages, with MACs when a shared secret is configured.

    With a secret, every body carries an HMAC-SHA256 tag over a direction label and the body.
    The body lists a keyed BLAKE3-256 MAC per data frame, in ``dmacs``.
    SHA-256 over every data frame would cost more CPU than the copy it protects.
    Keyed BLAKE3 costs less and is a PRF in its own right.
    """

    def __init__(self, secret: bytes | None, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.authenticated = secret is not None
        if secret is not None:
            self._control_key = blake3.blake3(secret, derive_key_context=_CONTROL_CONTEXT).digest()
            self._data_key = blake3.blake3(secret, derive_key_context=_DATA_CONTEXT).digest()

    def _tag(self, label: bytes, body: bytes) -> bytes:
        return hmac.new(self._control_key, label + body, hashlib.sha256).digest()

    def _data_mac(self, frame: Any) -> bytes:
        return blake3.blake3(frame, key=self._data_key).digest()

    def encode(
        self, body: Mapping[str, Any], data: Sequence[Any] = (), *, reply: bool, sign: bool = True
    ) -> list[Any]:
        """Frames ``[body, tag, data...]`` for ``body``, a map, and ``data``, buffers."""
        fields = dict(body)
        if self.authenticated and data and sign:
            fields["dmacs"] = [self._data_mac(frame) for frame in data]
        packed = _msgpack().packb(fields, use_bin_type=True)
        tag = (
            self._tag(_REPLY_LABEL if reply else _REQUEST_LABEL, packed)
            if (self.authenticated and sign)
            else b""
        )
        return [packed, tag, *data]

    def decode(
        self, frames: Sequence[Any], *, reply: bool
    ) -> tuple[dict[str, Any], list[Any], bool]:
        """Parse ``[body, tag, data...]``. Returns (body, data frames, authentic).

        Raises :class:`ProtocolViolation` for anything malformed or oversized.
        ``authentic`` is False only when a secret is configured and the tag is wrong.
        The caller decides what an unauthenticated message may do.
        """
        if len(frames) < 2:
            raise ProtocolViolation(
                MALFORMED, f"a message has at least 2 frames, got {len(frames)}"
            )
        if len(frames) - 2 > self.limits.max_keys:
            raise ProtocolViolation(
                TOO_LARGE, f"{len(frames) - 2} data frames exceed the key limit"
            )
        body_bytes, tag = _as_bytes(frames[0]), _as_bytes(frames[1])
        if len(body_bytes) > self.limits.max_control_bytes:
            raise ProtocolViolation(
                TOO_LARGE,
                f"control frame of {len(body_bytes)} bytes exceeds {self.limits.max_control_bytes}",
            )
        data = list(frames[2:])
        total = 0
        for frame in data:
            size = len(frame.buffer) if hasattr(frame, "buffer") else len(frame)
            if size > self.limits.max_frame_bytes:
                raise ProtocolViolation(TOO_LARGE, f"data frame of {size} bytes exceeds the limit")
            total += size
        if total > self.limits.max_message_bytes:
            raise ProtocolViolation(TOO_LARGE, f"{total} data bytes exceed the per-message limit")
        msgpack = _msgpack()
        limit = self.limits.max_control_bytes
        try:
            body = msgpack.unpackb(
                body_bytes,
                raw=False,
                strict_map_key=True,
                use_list=True,
                max_bin_len=limit,
                max_str_len=limit,
                max_array_len=limit,
                max_map_len=1024,
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises several unrelated types for garbage input
            raise ProtocolViolation(
                MALFORMED, f"the body is not msgpack: {type(exc).__name__}"
            ) from None
        if not isinstance(body, dict):
            raise ProtocolViolation(MALFORMED, "the body is not a map")
        authentic = True
        if self.authenticated:
            expected = self._tag(_REPLY_LABEL if reply else _REQUEST_LABEL, body_bytes)
            authentic = len(tag) == TAG_BYTES and hmac.compare_digest(expected, tag)
            if authentic and data:
                macs = body.get("dmacs")
                if not isinstance(macs, list) or len(macs) != len(data):
                    authentic = False
                else:
                    authentic = all(
                        isinstance(m, bytes) and hmac.compare_digest(m, self._data_mac(_buffer(f)))
                        for m, f in zip(macs, data)
                    )
        return body, data, authentic


def _buffer(frame: Any) -> Any:
    """The bytes-like content of a zmq.Frame or a plain buffer."""
    return frame.buffer if hasattr(frame, "buffer") else frame


def _as_bytes(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def new_token(size: int) -> bytes:
    """A random session or lease id."""
    return os.urandom(size)


def error_body(request_id: int, code: str, reason: str, **extra: Any) -> dict[str, Any]:
    """The reply body for a refused request."""
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "ok": False,
        "error": code,
        "reason": reason,
        **extra,
    }


def ok_body(request_id: int, **fields: Any) -> dict[str, Any]:
    """The reply body for a request that succeeded."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "ok": True, **fields}
