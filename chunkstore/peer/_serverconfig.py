"""How a peer server listens, whom it accepts and what it offers (:class:`PeerServerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkstore.errors import ConfigError
from chunkstore.format import ChunkLayout
from chunkstore.peer import _protocol as P


@dataclass(frozen=True, slots=True)
class PeerServerConfig:
    """How a peer server listens, whom it accepts and what it offers."""

    bind: str = "tcp://127.0.0.1:0"
    """ZeroMQ endpoint to listen on. Port 0 picks a free port. Loopback by default.
    ``ipc:///path`` serves the engines of this machine over a unix socket.
    The socket is created owner-only, 0600.
    Sessions then last as long as their connection, as in the node service."""
    name: str | None = None
    """Name in registries and ``stats`` (default: host:port)."""
    fingerprint: bytes | None = None
    """Model fingerprint served. Clients with another one are refused. ``None`` serves any."""
    chunk_tokens: int | None = None
    """Tokens per chunk served. Clients with another size are refused. ``None`` serves any."""
    secret: bytes | str | None = None
    """Shared secret for HMAC authentication of every message (default: $CHUNKSTORE_PEER_SECRET)."""
    use_env_secret: bool = True
    """Whether an unset ``secret`` falls back to $CHUNKSTORE_PEER_SECRET."""
    curve_secret_key: bytes | None = None
    """Z85 CURVE secret key: encrypts the control and inline data traffic when set."""
    curve_public_key: bytes | None = None
    """Z85 CURVE public key matching ``curve_secret_key`` (published to clients)."""
    curve_client_keys: tuple[bytes, ...] | None = None
    """Z85 public keys of clients allowed to connect under CURVE. ``None`` allows any key."""
    planes: tuple[str, ...] = (P.PLANE_NIXL, P.PLANE_INLINE)
    """Data planes offered. NIXL is dropped automatically when it cannot start.
    ``shm``, the shared slot pool, needs an ``ipc://`` bind and a store whose host pool is
    shared."""
    staging_bytes: int = 64 << 20
    """NIXL staging arena for chunks of stores that cannot pin in place."""
    default_lease_ms: int = 5_000
    """Lease length when a client asks for 0."""
    max_lease_ms: int = 30_000
    """Longest lease granted. Longer requests are clamped."""
    session_idle_s: float = 300.0
    """Sessions (and their leases) idle this long are dropped."""
    max_sessions: int = 1024
    """Most sessions held at once. At the cap a ``hello`` evicts the least recently used
    session idle for ``session_evict_idle_s``, or is refused with ``too_many_sessions``."""
    max_sessions_per_client: int = 64
    """Most sessions of one client identity: its source address and ``client`` name.
    A further ``hello`` of that identity evicts its least recently used session."""
    session_evict_idle_s: float = 1.0
    """Under pressure, sessions idle at least this long may be evicted for a new one."""
    workers: int = 4
    """Threads running store calls."""
    read_only: bool = False
    """Refuse ``push`` and ``delete``."""
    verify_push: bool = True
    """Check every pushed chunk (checksum, key, fingerprint) before storing it. Turn off only
    when every reader verifies anyway and the pushers are trusted."""
    limits: P.Limits = field(default_factory=P.Limits)
    """Message size limits."""
    seal_layout: ChunkLayout | None = None
    """The served model's chunk layout, from ``chunkstore serve --spec``.
    With it a node service assembles and seals the chunks of TP engines.
    Their ranks each write some heads.
    Without it TP ranks cannot save through it. This is for the ``shm`` plane only."""
    handle_on_io_thread: bool | None = None
    """Answer requests on the I/O thread instead of the worker pool.
    It saves a thread hop per request.
    Only for stores that never block.
    ``None`` means yes for in-memory stores, of kind ``memory`` or ``host``, and no otherwise.
    A tiered store may read a disk."""


def check_server_config(config: PeerServerConfig) -> None:
    """Raise ConfigError naming the first inconsistent option of ``config``."""
    if config.default_lease_ms <= 0 or config.max_lease_ms < config.default_lease_ms:
        raise ConfigError("need 0 < default_lease_ms <= max_lease_ms")
    unknown = set(config.planes) - set(P.PLANES)
    if unknown or not config.planes:
        raise ConfigError(
            f"unknown data planes {sorted(unknown)}; use {', '.join(map(repr, P.PLANES))}"
        )
    if P.PLANE_SHM in config.planes and not is_local(config):
        raise ConfigError(f"the shm data plane needs an ipc:// bind, not {config.bind!r}")
    if (config.curve_secret_key is None) != (config.curve_public_key is None):
        raise ConfigError("CURVE needs both curve_secret_key and curve_public_key")
    if config.max_sessions < 1 or config.max_sessions_per_client < 1:
        raise ConfigError("max_sessions and max_sessions_per_client must be at least 1")
    if not config.session_evict_idle_s >= 0:
        raise ConfigError("session_evict_idle_s must be >= 0")


def is_local(config: PeerServerConfig) -> bool:
    """Whether the server listens on a unix socket of this machine (the node service)."""
    return config.bind.startswith("ipc://")


__all__ = ["PeerServerConfig", "check_server_config", "is_local"]
