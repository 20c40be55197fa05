"""The connector's options from ``kv_connector_extra_config``, parsed and validated.

:data:`OPTIONS` lists every option with its meaning. An unknown key or a bad
value raises :class:`~chunkstore.errors.ConfigError` that names the option. A
typo thus fails ``vllm serve`` at start-up. This module does not import vLLM.
The scheduler and the tests parse configs without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chunkstore import units
from chunkstore.backends._registry import check_url, naming_option
from chunkstore.cache.policy import DEFAULT_POLICY, POLICY_NAMES
from chunkstore.errors import ChunkStoreError, ConfigError
from chunkstore.units import shown

__all__ = ["OPTIONS", "ConnectorConfig", "parse_config", "parse_size"]

OPTIONS: dict[str, str] = {
    "host_cache": "Host memory for chunks (tier 0), e.g. '8G', '512MiB' or bytes. Default '2G'.",
    "host_policy": "Host cache eviction policy: 'parc' (prefix-aware ARC, default), 'arc', 'lru'.",
    "tiers": "Secondary tiers, fastest first: a URL or a list of URLs "
    "('file:///mnt/kv', '/mnt/kv', 's3://bucket/prefix'). Default: none.",
    "chunk_tokens": "Tokens per chunk; a multiple of the engine's block size. Default 256.",
    "blocks_per_chunk": "Instead of chunk_tokens: chunk_tokens = blocks_per_chunk * block_size.",
    "model_id": "Name of the model in the namespace (default: the engine's model name/path). "
    "Set it when instances load the same weights from different paths.",
    "namespace": "Extra string mixed into the namespace root (e.g. a deployment or tenant id).",
    "load": "Load hits from the store (default true; false for a kv_producer).",
    "save": "Save computed chunks (default true; false for a kv_consumer).",
    "save_decode": "Also save full chunks of generated tokens (multi-turn reuse). Default true.",
    "prefetch_timeout_s": "How long a request waits for a secondary tier to bring its hit into "
    "host memory before the hit is shortened to what arrived: seconds or an age like '30s'. "
    "Default 10.",
    "verify_host": "Verify checksums of chunks read from host memory too (tiers verify what "
    "they return unless store_options set their verify to false). Default false.",
    "compression": "Compression of chunks written to secondary tiers: 'none' (default) or 'zstd'.",
    "store_options": "Mapping of URL -> keyword options passed to open_store for that tier.",
    "shared_pool": "Name of the shared host pool the TP ranks of one instance attach to "
    "(default: derived from the engine id).",
    "metrics_port": "Serve the library's chunkstore_* metrics at http://127.0.0.1:PORT/metrics "
    "from the engine process (0 picks a free port). Default: off.",
    "node": "Use this machine's node service instead of a host cache of the engine's own: "
    "unix:///path of the socket `chunkstore serve --node` listens on. Default: off.",
}


MAX_CHUNK_TOKENS = 1 << 20
"""Most tokens per chunk."""
MAX_TIERS = 16
"""Most secondary tiers."""
MAX_TEXT = 1024
"""Longest string option or tier URL, in characters."""


def parse_size(value: Any, option: str = "size") -> int:
    """Bytes from an int or a string such as ``8G``, ``512MiB`` or ``1.5g``.

    :mod:`chunkstore.units` parses the string. The size must be positive.
    Errors name ``option``.
    """
    try:
        n = units.parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"{option}: {exc}") from None
    if n <= 0:
        raise ConfigError(f"{option}: must be positive, got {shown(value)}")
    return n


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Validated connector options; :data:`OPTIONS` says what each one means."""

    host_cache_bytes: int
    """Host cache capacity in bytes."""
    host_policy: str
    """Host eviction policy: one of :data:`~chunkstore.cache.policy.POLICY_NAMES`."""
    tiers: tuple[str, ...]
    """Secondary tier URLs, fastest first."""
    chunk_tokens: int
    """Tokens per chunk, a multiple of the block size."""
    model_id: str | None
    """Namespace model name override; None means the engine's model name."""
    namespace: str | None
    """Extra namespace string."""
    load: bool
    """Whether hits are loaded."""
    save: bool
    """Whether chunks are saved."""
    save_decode: bool
    """Whether chunks of generated tokens are saved."""
    prefetch_timeout_s: float
    """Secondary-tier prefetch deadline per request."""
    verify_host: bool
    """Whether chunks read from host memory are verified."""
    compression: str
    """Compression for secondary tiers: 'none' or 'zstd'."""
    store_options: Mapping[str, Mapping[str, Any]]
    """Per-URL store options."""
    shared_pool: str | None
    """Shared host pool name, or None for the default."""
    metrics_port: int | None
    """Port of the chunkstore_* metrics endpoint; None means no endpoint."""
    node: str | None = None
    """The node service's endpoint, such as ``ipc:///path``; None means the engine's own cache."""


def _bool(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"{name}: expected true or false, got {shown(value)}")


def positive_int_option(value: Any, name: str, maximum: int) -> int:
    """Option ``name`` as an integer from 1 to ``maximum``.

    The value may be an int or a string of digits. Any other value raises a
    one-line :class:`ConfigError` that names the option.
    """
    expected = f"{name}: expected an integer 1..{maximum}, got {shown(value)}"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(expected)
    try:
        n = int(value)
    except ValueError:  # also a string of more digits than int() converts
        raise ConfigError(expected) from None
    if not 0 < n <= maximum:
        raise ConfigError(expected)
    return n


def seconds_option(extra: Mapping[str, Any], name: str, default: float) -> float:
    """Duration option ``name`` of ``extra``, in seconds.

    An absent option is ``default``. :func:`~chunkstore.units.parse_age` sets
    the bounds. Errors name the option.
    """
    try:
        return units.parse_age(extra.get(name, default))
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _choice(extra: Mapping[str, Any], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = extra.get(name, default)
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {shown(value)}")
    return value.lower()


def _port(extra: Mapping[str, Any], name: str) -> int | None:
    value = extra.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ConfigError(f"{name}: expected a TCP port number 0..65535, got {shown(value)}")
    return value


def _optional_str(extra: Mapping[str, Any], name: str) -> str | None:
    value = extra.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT:
        raise ConfigError(
            f"{name}: expected a non-empty string of at most {MAX_TEXT} characters, "
            f"got {shown(value)}"
        )
    return value


def _tiers(value: Any) -> tuple[str, ...]:
    """The ``tiers`` option: URLs checked for a known scheme and installed extras."""
    if isinstance(value, str):
        value = [value]
    if (
        not isinstance(value, (list, tuple))
        or len(value) > MAX_TIERS
        or not all(isinstance(t, str) and t.strip() and len(t) <= MAX_TEXT for t in value)
    ):
        raise ConfigError(
            f"tiers: expected a URL or a list of at most {MAX_TIERS} URLs, got {shown(value)}"
        )
    tiers = tuple(t.strip() for t in value)
    if len(set(tiers)) != len(tiers):
        raise ConfigError(f"tiers: a URL is listed twice in {list(tiers)}")
    for url in tiers:
        try:
            # memory:// is refused: a tier in the scheduler's memory is what the host cache is
            check_url(url, in_process=False)
        except ChunkStoreError as exc:
            raise naming_option(exc, "tiers", url) from None
    return tiers


def parse_config(
    extra: Mapping[str, Any] | None, *, block_size: int, kv_role: str | None = None
) -> ConnectorConfig:
    """Validate ``kv_connector_extra_config`` against the engine's ``block_size``.

    ``kv_role`` is ``kv_producer``, ``kv_consumer`` or ``kv_both``. It sets the
    defaults of ``load`` and ``save``. ``extra`` is a mapping, or None for all
    defaults.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        # A string such as "host_cache=2G" is the usual mistake. dict() of it raises a
        # ValueError that names no option.
        raise ConfigError(
            "kv_connector_extra_config: expected a JSON object of options, e.g. "
            f'{{"host_cache": "8G", "tiers": ["/mnt/kv"]}}, got {shown(extra)}'
        )
    extra = dict(extra)
    unknown = sorted(map(str, set(extra) - set(OPTIONS)))
    if unknown:
        raise ConfigError(
            f"unknown ChunkStoreConnector option(s) {', '.join(map(shown, unknown))}; "
            f"valid options: {', '.join(sorted(OPTIONS))}"
        )

    if "chunk_tokens" in extra and "blocks_per_chunk" in extra:
        raise ConfigError("chunk_tokens and blocks_per_chunk: give one of them, not both")
    if "blocks_per_chunk" in extra:
        most = max(1, MAX_CHUNK_TOKENS // block_size)
        chunk_tokens = positive_int_option(extra["blocks_per_chunk"], "blocks_per_chunk", most)
        chunk_tokens *= block_size
    else:
        chunk_tokens = positive_int_option(
            extra.get("chunk_tokens", 256), "chunk_tokens", MAX_CHUNK_TOKENS
        )
        if chunk_tokens % block_size:
            raise ConfigError(
                f"chunk_tokens: {chunk_tokens} is not a multiple of the engine's block size "
                f"{block_size}"
            )

    tiers = _tiers(extra.get("tiers", ()))

    store_options = extra.get("store_options", {})
    if not isinstance(store_options, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Mapping) for k, v in store_options.items()
    ):
        raise ConfigError("store_options: expected a mapping of tier URL -> mapping of options")
    stray = sorted(set(store_options) - set(tiers))
    if stray:
        raise ConfigError(
            f"store_options: {shown(stray)} are not among the tiers {shown(list(tiers))}"
        )

    node = _node(extra.get("node"), tiers)
    role = kv_role or "kv_both"
    return ConnectorConfig(
        host_cache_bytes=parse_size(extra.get("host_cache", "2G"), "host_cache"),
        host_policy=_choice(extra, "host_policy", DEFAULT_POLICY, POLICY_NAMES),
        tiers=tiers,
        chunk_tokens=chunk_tokens,
        model_id=_optional_str(extra, "model_id"),
        namespace=_optional_str(extra, "namespace"),
        load=_bool(extra, "load", role != "kv_producer"),
        save=_bool(extra, "save", role != "kv_consumer"),
        save_decode=_bool(extra, "save_decode", True),
        prefetch_timeout_s=seconds_option(extra, "prefetch_timeout_s", 10.0),
        verify_host=_bool(extra, "verify_host", False),
        compression=_choice(extra, "compression", "none", ("none", "zstd")),
        store_options={k: dict(v) for k, v in store_options.items()},
        shared_pool=_optional_str(extra, "shared_pool"),
        metrics_port=_port(extra, "metrics_port"),
        node=node,
    )


def _node(value: Any, tiers: tuple[str, ...]) -> str | None:
    """The ``node`` option as a ZeroMQ endpoint; the tiers are then the service's."""
    if value is None:
        return None
    from chunkstore.node import node_endpoint

    try:
        endpoint = node_endpoint(value)
    except ConfigError as exc:
        raise ConfigError(f"node: {exc}") from None
    if tiers:
        raise ConfigError(
            "node: the node service owns the tiers; give them to `chunkstore serve --store`, "
            "not to the engine's `tiers`"
        )
    return endpoint
