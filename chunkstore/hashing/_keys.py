"""Prefix-chained chunk keys, see spec/FORMAT.md, section "Key derivation".

``key_0 = BLAKE3(root || tokens[0:C])`` and ``key_i = BLAKE3(key_{i-1} || tokens[iC:(i+1)C])``.
Tokens are little-endian uint32.
Nothing here depends on the Python process: no ``hash()``, no pickle.
So every machine derives the same keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3

from chunkstore.errors import ConfigError, KeyParseError

if TYPE_CHECKING:
    import numpy as np

DIGEST_SIZE = 32
NAMESPACE_HEX_CHARS = 16
_ROOT_CONTEXT = "chunkstore 2026-11 namespace root v1"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAMESPACE = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True, slots=True, order=True)
class ChunkKey:
    """The address of one chunk: a BLAKE3-256 digest plus the namespace it lives in."""

    digest: bytes
    """32 bytes, BLAKE3(parent || tokens)."""
    namespace: str
    """16 lower-case hex digits: the first 8 bytes of the namespace root (storage directory)."""

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_SIZE:
            raise KeyParseError(
                f"a chunk key digest has {DIGEST_SIZE} bytes, got {len(self.digest)}"
            )
        if not _NAMESPACE.fullmatch(self.namespace):
            raise KeyParseError(
                f"namespace must be 16 lower-case hex digits, got {self.namespace!r}"
            )

    @property
    def hex(self) -> str:
        """The digest as 64 lower-case hex digits."""
        return self.digest.hex()

    @property
    def path(self) -> str:
        """Relative storage path: ``<namespace>/<ab>/<cd>/<hex>.kvc`` (two-level fan-out)."""
        h = self.digest.hex()
        return f"{self.namespace}/{h[0:2]}/{h[2:4]}/{h}.kvc"

    def __str__(self) -> str:
        return self.digest.hex()

    @classmethod
    def parse(cls, text: str, namespace: str) -> ChunkKey:
        """Parse 64 lower-case hex digits; anything else raises :class:`KeyParseError`."""
        if not isinstance(text, str) or not _HEX64.fullmatch(text):
            raise KeyParseError(f"not a chunk key (need 64 lower-case hex digits): {text!r}")
        return cls(bytes.fromhex(text), namespace)

    @classmethod
    def parse_path(cls, path: str) -> ChunkKey:
        """Parse ``[...]/<namespace>/<ab>/<cd>/<hex>.kvc`` back into a key; raises otherwise."""
        parts = path.replace("\\", "/").rstrip("/").split("/")
        if len(parts) < 4 or not parts[-1].endswith(".kvc"):
            raise KeyParseError(f"not a chunk path: {path!r}")
        namespace, fan1, fan2, name = parts[-4], parts[-3], parts[-2], parts[-1][: -len(".kvc")]
        key = cls.parse(name, namespace)
        if fan1 != name[0:2] or fan2 != name[2:4]:
            raise KeyParseError(f"chunk path fan-out does not match its name: {path!r}")
        return key


def is_namespace(text: object) -> bool:
    """Whether ``text`` is a storage namespace: 16 lower-case hex digits (nothing path-like)."""
    return isinstance(text, str) and _NAMESPACE.fullmatch(text) is not None


def check_namespace(text: object) -> str:
    """``text`` if it is a storage namespace, else :class:`ConfigError` (one line, the value)."""
    if not is_namespace(text):
        raise ConfigError(f"a namespace is 16 lower-case hex digits, got {text!r}")
    assert isinstance(text, str)
    return text


def namespace_of(root: bytes) -> str:
    """The storage namespace of a namespace root: its first 8 bytes in hex."""
    return root[: NAMESPACE_HEX_CHARS // 2].hex()


_INT_RANGE = range(-(2**63), 2**64)


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{what} is not valid Unicode (a lone surrogate)") from None


def _encode_value(name: str, value: Any) -> bytes:
    """``v`` of spec section 5.2: a type tag byte, then the value's bytes."""
    if isinstance(value, bool):
        # Spelled as chunkstore 1.0 wrote it (Python's str), so existing keys stay valid.
        return b"sTrue" if value else b"sFalse"
    if isinstance(value, int):
        if value not in _INT_RANGE:
            raise ConfigError(f"extra key {name!r}: integer {value} is outside [-2**63, 2**64)")
        return b"s" + str(value).encode("ascii")
    if isinstance(value, str):
        return b"s" + _utf8(value, f"extra key {name!r}")
    if isinstance(value, (bytes, bytearray)):
        return b"b" + bytes(value)
    if isinstance(value, (list, tuple)):
        if any(item is None for item in value):
            raise ConfigError(f"extra key {name!r}: a list must not hold None")
        return b"l" + _encode_pairs((str(i), item) for i, item in enumerate(value))
    raise ConfigError(
        f"extra key {name!r} must be str, int, bool, bytes or a list of them, "
        f"not {type(value).__name__}"
    )


def _encode_pairs(pairs: Iterable[tuple[str, Any]]) -> bytes:
    out = bytearray()
    for name, value in pairs:
        name_bytes = _utf8(name, f"extra key name {name!r}")
        encoded = _encode_value(name, value)
        out += len(name_bytes).to_bytes(4, "little") + name_bytes
        out += len(encoded).to_bytes(8, "little") + encoded
    return bytes(out)


def _name(pair: tuple[str, Any]) -> str:
    return pair[0]


def encode_extra(extra: Mapping[str, Any] | None) -> bytes:
    """``encode_extra`` of spec section 5.2: the bytes the namespace root hashes after the
    fingerprint.

    Names are sorted by code point, ``None`` values dropped, and lists kept in their order.
    Anything outside the closed set of value types raises :class:`ConfigError`.
    So no input depends on how a language prints it.
    """
    if extra is None:
        return b""
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"extra keys must be a mapping of names to values, not {type(extra).__name__}"
        )
    for name in extra:
        if not isinstance(name, str):
            raise ConfigError(f"extra key names must be strings, got {name!r}")
    return _encode_pairs(sorted(((k, v) for k, v in extra.items() if v is not None), key=_name))


def namespace_root(model_fingerprint: bytes, *, extra: Mapping[str, Any] | None = None) -> bytes:
    """Derive the 32-byte namespace root from a model fingerprint and optional extra keys.

    ``extra`` holds whatever makes KV for the same tokens differ, or must not be shared.
    Examples are a LoRA id, multimodal content hashes, and a tenant ``cache_salt``.
    Keys are sorted and ``None`` values are dropped, so ``{"lora": None}`` equals ``{}``.
    Values are str, int, bool, bytes, or lists of these, see spec section 5.2.
    """
    if len(model_fingerprint) != DIGEST_SIZE:
        raise ConfigError(
            f"a model fingerprint has {DIGEST_SIZE} bytes, got {len(model_fingerprint)}"
        )
    hasher = blake3.blake3(derive_key_context=_ROOT_CONTEXT)
    hasher.update(model_fingerprint)
    hasher.update(encode_extra(extra))
    return hasher.digest()


def tokens_as_le_u32(tokens: Any) -> np.ndarray:
    """Tokens (list, numpy array, torch tensor) as a contiguous little-endian uint32 array."""
    import numpy as np

    if hasattr(tokens, "detach") and hasattr(
        tokens, "cpu"
    ):  # torch.Tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ConfigError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ConfigError(f"tokens must be integers, got dtype {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > 0xFFFFFFFF):
        raise ConfigError("token ids must fit in uint32")
    return np.ascontiguousarray(array, dtype="<u4")


def chain_digest(parent: bytes, token_bytes: bytes | memoryview) -> bytes:
    """One link of the chain: BLAKE3(parent || tokens as LE uint32)."""
    hasher = blake3.blake3(parent)
    hasher.update(token_bytes)
    return hasher.digest()


def chain_keys(
    tokens: Any, *, root: bytes, chunk_tokens: int, after: ChunkKey | None = None
) -> list[ChunkKey]:
    """One key per full chunk of ``tokens``; a partial tail gets none.

    ``root`` is the 32-byte namespace root, see :func:`namespace_root`.
    The i-th key covers ``tokens[i*chunk_tokens:(i+1)*chunk_tokens]``.
    Through the chain it covers every token before it too.
    ``after`` is the key of the chunk just before ``tokens[0]``, under the same root.
    It goes on with a chain already computed, instead of hashing its prefix again.
    """
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if len(root) != DIGEST_SIZE:
        raise ConfigError(f"a namespace root has {DIGEST_SIZE} bytes, got {len(root)}")
    data = memoryview(tokens_as_le_u32(tokens).tobytes())
    step = chunk_tokens * 4
    full = len(data) // step
    namespace = namespace_of(root)
    keys: list[ChunkKey] = []
    parent = bytes(root) if after is None else after.digest
    for i in range(full):
        parent = chain_digest(parent, data[i * step : (i + 1) * step])
        keys.append(ChunkKey(parent, namespace))
    return keys


def parent_of(keys: Sequence[ChunkKey], index: int, root: bytes) -> bytes:
    """The parent digest of ``keys[index]``: the previous key, or the root for the first."""
    return bytes(root) if index == 0 else keys[index - 1].digest
