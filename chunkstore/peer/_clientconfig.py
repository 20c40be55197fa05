"""How a peer client is configured: its settings and the endpoint it connects to."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from chunkstore.errors import ConfigError, MissingDependency
from chunkstore.peer import _protocol as P

AUTO = "auto"

_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s;/\[\]]+):([0-9]{1,5})")


def peer_endpoint(text: str) -> str:
    """Return the ZeroMQ endpoint to connect to for ``text``.

    ``text`` is ``host:port``, ``tcp://host:port`` or ``ipc:///path``.
    Anything else raises ConfigError naming ``text``.
    """
    # Checked here: ZeroMQ would raise on every connect, or read ``a;b`` as a source and a
    # destination.
    endpoint = text if text.startswith(("tcp://", "ipc://")) else f"tcp://{text}"
    if endpoint.startswith("ipc://"):
        if len(endpoint) > len("ipc://") and not any(c.isspace() for c in endpoint):
            return endpoint
    else:
        match = _TCP_ENDPOINT.fullmatch(endpoint)
        if match is not None and 1 <= int(match.group(2)) <= 65535:
            return endpoint
    raise ConfigError(
        f"peer endpoint {text!r} is not host:port, tcp://host:port (port 1..65535) or ipc:///path"
    )


def zmq_module() -> Any:
    """Return the ``zmq`` module, or raise MissingDependency naming the extra to install."""
    try:
        import zmq
    except ImportError:
        raise MissingDependency(
            "the peer store needs pyzmq and msgpack: pip install 'chunkstore[peer]'"
        ) from None
    return zmq


@dataclass(frozen=True, slots=True)
class PeerClientConfig:
    """How a client talks to peers."""

    fingerprint: bytes | None = None
    """Our model fingerprint. A peer serving another one refuses us. ``None`` skips the check."""
    chunk_tokens: int | None = None
    """Our tokens per chunk, checked like the fingerprint."""
    secret: bytes | str | None = None
    """Shared secret for message authentication. Defaults to $CHUNKSTORE_PEER_SECRET."""
    use_env_secret: bool = True
    """Whether an unset ``secret`` falls back to $CHUNKSTORE_PEER_SECRET."""
    curve_server_key: bytes | None = None
    """Z85 CURVE public key of the server. Setting it enables encryption.
    The server must use CURVE too."""
    curve_public_key: bytes | None = None
    """Our Z85 CURVE public key. A fresh key pair is made when unset."""
    curve_secret_key: bytes | None = None
    """Our Z85 CURVE secret key."""
    plane: str = AUTO
    """Data plane: ``auto``, ``nixl``, ``inline`` or ``shm``.
    ``auto`` uses NIXL when both sides have it, else inline.
    ``shm`` is a node service's shared slot pool, see :class:`chunkstore.node.NodeClient`."""
    slot_size: int | None = None
    """Our chunk size in bytes, sent in ``hello`` for the ``shm`` plane.
    A node whose pool slots differ refuses us with ``geometry_mismatch``.
    ``None`` sends nothing."""
    timeout_s: float = 2.0
    """Bound on every request, NIXL transfer included. Past it the request is a miss.
    A ``PeerStore`` call is bounded by it in total, however many requests it makes."""
    retry_after_s: float = 2.0
    """How long the peer counts as down after a timeout. Requests fail at once meanwhile."""
    lease_ms: int = 5_000
    """Lease asked for on NIXL fetches."""
    recv_arena_bytes: int = 64 << 20
    """Size of the NIXL receive and send arena.
    Larger batches are read and pushed in rounds that fit it.
    A single chunk larger than the arena cannot cross NIXL: it is a miss, or not pushed."""
    client_name: str | None = None
    """How we introduce ourselves. Defaults to host:pid."""
    immediate: bool = False
    """Queue requests only on a live connection (ZMQ_IMMEDIATE).
    A request to a server whose connection closed then fails at once, not after ``timeout_s``.
    ``hello`` waits up to ``timeout_s`` for the connection.
    Meant for a node service on a unix socket, whose death the kernel reports at once."""
    keep_session_on_timeout: bool = False
    """Keep the connection and the session after a request times out.
    The peer is still marked down.
    Meant for a node service, which ends a session with its connection.
    Closing it would release every pin and reservation the client still uses.
    A late reply that grants a lease has that lease given back."""
    limits: P.Limits = field(default_factory=P.Limits)
    """Limits on replies we accept."""
