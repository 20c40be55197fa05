"""The layout-independent description of a model's KV cache and its fingerprint."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import blake3

from chunkstore.errors import ConfigError
from chunkstore.format._dtypes import dtype_named


class LayerKind(str, Enum):
    """What a layer group stores per layer (spec/FORMAT.md 3.2). A ``str`` whose value is the
    name the canonical JSON and the spec use, so ``LayerKind.MLA == "mla"``."""

    ATTENTION = "attention"
    """K and V per head (full attention)."""
    SLIDING_WINDOW = "sliding_window"
    """K and V per head, of a sliding-window layer."""
    MLA = "mla"
    """One latent vector per token (multi-head latent attention)."""
    STATE = "state"
    """One state tensor per chunk (linear attention, SSM)."""

    # The plain value in messages and f-strings on every Python version (3.12's format()
    # of a mixed-in enum goes through __str__, which Enum makes the member name).
    __str__ = str.__str__


ATTENTION = LayerKind.ATTENTION
SLIDING_WINDOW = LayerKind.SLIDING_WINDOW
MLA = LayerKind.MLA
STATE = LayerKind.STATE
KINDS: tuple[LayerKind, ...] = tuple(LayerKind)
"""Every layer-group kind, in spec order."""


MAX_SPEC_INT = 2**63 - 1
"""Largest integer a KVSpec may hold: every implementation can hash it as a signed 64-bit."""


def _require_int(name: str, value: Any) -> None:
    # The canonical JSON must not depend on a language's number printing: integers only,
    # and none that a reader with 64-bit integers could not represent (spec section 5.1).
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if not -MAX_SPEC_INT <= value <= MAX_SPEC_INT:
        raise ConfigError(f"{name} must be below 2**63 in magnitude, got {value}")


def _require_text(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{name} is not valid Unicode (a lone surrogate): {value!r}") from None


def _extra_pair(pair: Any) -> tuple[Any, ...]:
    if not isinstance(pair, (list, tuple)):
        raise ConfigError(f"KVSpec extra entries are [name, value] pairs, got {pair!r}")
    return tuple(pair)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that share one KV shape and kind."""

    kind: LayerKind
    """What the group stores (its name as a string is accepted and converted)."""
    layers: tuple[int, ...]
    """Global layer indices, in model order."""
    num_kv_heads: int = 1
    """Total (not per-rank) KV heads; 1 for MLA and state groups."""
    head_dim: int = 0
    """Elements per head per token (the latent width for MLA)."""
    sliding_window: int | None = None
    """Window in tokens for ``sliding_window`` groups; informative only."""
    state_shape: tuple[int, ...] = ()
    """Shape of the per-chunk state tensor of each layer, for ``state`` groups."""

    def __post_init__(self) -> None:
        for name in (
            "num_kv_heads",
            "head_dim",
            *(("sliding_window",) if self.sliding_window is not None else ()),
        ):
            _require_int(name, getattr(self, name))
        for value in (*self.layers, *self.state_shape):
            _require_int("layers and state_shape entries", value)
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive or None, got {self.sliding_window}")
        try:
            # frozen: the one place the field is set after __init__ (normalising str to enum)
            object.__setattr__(self, "kind", LayerKind(self.kind))
        except ValueError:
            names = tuple(k.value for k in LayerKind)
            raise ConfigError(
                f"layer group kind must be one of {names}, got {self.kind!r}"
            ) from None
        if not self.layers or len(set(self.layers)) != len(self.layers) or min(self.layers) < 0:
            raise ConfigError(f"layer group needs distinct non-negative layers, got {self.layers}")
        if self.kind == STATE:
            if not self.state_shape or min(self.state_shape) <= 0:
                raise ConfigError("a state group needs a positive state_shape")
        elif self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ConfigError(f"{self.kind} group needs positive num_kv_heads and head_dim")
        # Fields a kind does not use have one fixed value (spec section 5.1): they are hashed
        # into the fingerprint, so any other value would give the same model other keys.
        if self.kind in (MLA, STATE) and self.num_kv_heads != 1:
            raise ConfigError(f"{self.kind} groups have exactly one (unsplit) head")
        if self.kind == STATE and self.head_dim != 0:
            raise ConfigError(f"a state group has head_dim 0, got {self.head_dim}")
        if self.kind != STATE and self.state_shape:
            raise ConfigError(f"a {self.kind} group has no state_shape, got {self.state_shape}")
        if self.kind != SLIDING_WINDOW and self.sliding_window is not None:
            raise ConfigError(f"a {self.kind} group has no sliding_window")

    def to_dict(self) -> dict[str, Any]:
        """Canonical dict (fixed keys) used for the fingerprint."""
        return {
            "kind": self.kind.value,
            "layers": list(self.layers),
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "sliding_window": self.sliding_window,
            "state_shape": list(self.state_shape),
        }


@dataclass(frozen=True, slots=True)
class KVSpec:
    """What a chunk's payload means: model, dtype, tokens per chunk and layer groups."""

    model_id: str
    """Model name or path as the engine knows it."""
    dtype: str
    """Element type of every tensor (safetensors name, e.g. ``"BF16"``)."""
    chunk_tokens: int
    """Tokens per chunk."""
    groups: tuple[LayerGroup, ...]
    """Layer groups; together they cover each layer once."""
    extra: tuple[tuple[str, str], ...] = field(default=())
    """Anything else that changes KV bytes (e.g. ``("kv_scale", "1.0")``), sorted pairs."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_named(self.dtype).name)
        _require_text("model_id", self.model_id)
        for pair in self.extra:
            if len(pair) != 2:
                raise ConfigError(f"KVSpec extra entries are (name, value) pairs, got {pair!r}")
            for text in pair:
                _require_text("KVSpec extra names and values", text)
        object.__setattr__(self, "extra", tuple(sorted(tuple(p) for p in self.extra)))
        names = [name for name, _ in self.extra]
        if len(set(names)) != len(names):
            raise ConfigError(f"KVSpec extra names must be distinct, got {names}")
        _require_int("chunk_tokens", self.chunk_tokens)
        if self.chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if not self.groups:
            raise ConfigError("a KVSpec needs at least one layer group")
        seen: set[int] = set()
        for group in self.groups:
            if seen & set(group.layers):
                raise ConfigError(f"layer(s) {sorted(seen & set(group.layers))} in two groups")
            seen |= set(group.layers)

    @classmethod
    def simple(
        cls,
        model_id: str,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "BF16",
        chunk_tokens: int = 256,
    ) -> KVSpec:
        """A plain decoder: one full-attention group over every layer."""
        group = LayerGroup(ATTENTION, tuple(range(num_layers)), num_kv_heads, head_dim)
        return cls(model_id, dtype, chunk_tokens, (group,))

    @property
    def num_layers(self) -> int:
        """Layers over all groups."""
        return sum(len(g.layers) for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        """Canonical dict; :meth:`from_dict` inverts it."""
        return {
            "model_id": self.model_id,
            "dtype": self.dtype,
            "chunk_tokens": self.chunk_tokens,
            "groups": [g.to_dict() for g in self.groups],
            "extra": [list(p) for p in self.extra],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVSpec:
        """Rebuild a spec from :meth:`to_dict` output (or hand-written JSON/YAML)."""
        # Values pass through unconverted: the constructors refuse what is not an integer
        # or a string, where int() or str() here would silently give another fingerprint.
        try:
            groups = tuple(
                LayerGroup(
                    kind=g["kind"],
                    layers=tuple(g["layers"]),
                    num_kv_heads=g.get("num_kv_heads", 1),
                    head_dim=g.get("head_dim", 0),
                    sliding_window=g.get("sliding_window"),
                    state_shape=tuple(g.get("state_shape", ())),
                )
                for g in data["groups"]
            )
            return cls(
                model_id=data["model_id"],
                dtype=data["dtype"],
                chunk_tokens=data["chunk_tokens"],
                groups=groups,
                extra=tuple(_extra_pair(pair) for pair in data.get("extra", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"invalid KV spec: {exc!r}") from exc

    def canonical_json(self) -> bytes:
        """Compact, key-sorted JSON: the exact bytes the fingerprint hashes."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def fingerprint(self) -> bytes:
        """32-byte BLAKE3 of :meth:`canonical_json`."""
        return blake3.blake3(self.canonical_json()).digest()
