"""Prometheus metrics of the peer server and client: ``chunkstore_peer_*``.

Like :class:`~chunkstore.metrics.ChunkstoreMetrics`, one :class:`PeerMetrics` holds every
peer metric registered in one registry.
Servers, clients and peer stores take one as ``metrics=``.
Without it they share :func:`default_peer_metrics`.
That one is registered in prometheus-client's default registry, which ``chunkstore serve``
exposes.
It is labelled by server name, so several servers and stores in one process report side
by side.
Build a :class:`PeerMetrics` on a private :class:`~prometheus_client.CollectorRegistry`
to keep metrics apart.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

CLIENT_SECONDS_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
)
"""Seconds, from a loopback round trip to a stalled peer."""


class PeerMetrics:
    """All ``chunkstore_peer_*`` metrics, registered in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = REGISTRY if registry is None else registry
        """Where the metrics are registered."""
        r = self.registry
        self.server_requests = Counter(
            "chunkstore_peer_server_requests_total",
            "Requests a peer server handled, by operation.",
            ["server", "op"],
            registry=r,
        )
        self.server_rejected = Counter(
            "chunkstore_peer_server_rejected_total",
            "Messages a peer server refused (malformed, too_large, auth_failed, "
            "unsupported_version, handshake_failed, ...).",
            ["server", "reason"],
            registry=r,
        )
        self.server_chunks = Counter(
            "chunkstore_peer_server_chunks_total",
            "Chunks asked of a peer server, by result (hit, miss).",
            ["server", "result"],
            registry=r,
        )
        self.server_bytes = Counter(
            "chunkstore_peer_server_bytes_total",
            "Chunk bytes a peer server sent (direction=out) or took in (direction=in), "
            "by data plane.",
            ["server", "plane", "direction"],
            registry=r,
        )
        self.server_leases = Gauge(
            "chunkstore_peer_server_leases",
            "Leases a peer server holds open.",
            ["server"],
            registry=r,
        )
        self.server_sessions = Gauge(
            "chunkstore_peer_server_sessions",
            "Sessions a peer server holds open (at most its max_sessions).",
            ["server"],
            registry=r,
        )
        self.server_sessions_evicted = Counter(
            "chunkstore_peer_server_sessions_evicted_total",
            "Sessions a peer server dropped to admit new ones, by cause (per_client: the "
            "client identity was at its cap; full: the server was at max_sessions).",
            ["server", "cause"],
            registry=r,
        )
        self.node_clients = Gauge(
            "chunkstore_node_clients",
            "Engines (connections) attached to a node service.",
            ["server"],
            registry=r,
        )
        self.node_client_leases = Gauge(
            "chunkstore_node_client_leases",
            "Leases (read pins and reservations) a node service holds for one client.",
            ["server", "client"],
            registry=r,
        )
        self.node_client_chunks = Counter(
            "chunkstore_node_client_chunks_total",
            "Chunks a node client asked for, by client and result (hit, miss).",
            ["server", "client", "result"],
            registry=r,
        )
        self.client_seconds = Histogram(
            "chunkstore_peer_client_request_seconds",
            "Round trip of a peer request, by operation and plane.",
            ["op", "plane"],
            buckets=CLIENT_SECONDS_BUCKETS,
            registry=r,
        )
        self.client_bytes = Counter(
            "chunkstore_peer_client_bytes_total",
            "Chunk bytes a peer client moved, by plane and direction.",
            ["plane", "direction"],
            registry=r,
        )
        self.client_failures = Counter(
            "chunkstore_peer_client_failures_total",
            "Peer requests that became misses (timeout, disconnected, not_sent, refused, "
            "transfer_failed, corrupt, ...); unsent_releases: a node session ended on purpose.",
            ["reason"],
            registry=r,
        )


_DEFAULT: PeerMetrics | None = None
_DEFAULT_LOCK = threading.Lock()


def default_peer_metrics() -> PeerMetrics:
    """This process's peer metrics, in prometheus-client's default registry (created on
    first use, so importing the package registers nothing)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = PeerMetrics()
        return _DEFAULT


__all__ = ["PeerMetrics", "default_peer_metrics"]
