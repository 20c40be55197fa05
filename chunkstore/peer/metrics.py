"""Prometheus metrics of the peer server and client (``chunkstore_peer_*``).

Defined once per process on the default registry, labelled by server name, so
several servers and stores in one process (tests, ``serve`` with offload) share
them without duplicate registration.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SERVER_REQUESTS = Counter(
    "chunkstore_peer_server_requests_total",
    "Requests a peer server handled, by operation.",
    ["server", "op"],
)
SERVER_REJECTED = Counter(
    "chunkstore_peer_server_rejected_total",
    "Messages a peer server refused (malformed, too_large, auth_failed, unsupported_version, "
    "handshake_failed, ...).",
    ["server", "reason"],
)
SERVER_CHUNKS = Counter(
    "chunkstore_peer_server_chunks_total",
    "Chunks asked of a peer server, by result (hit, miss).",
    ["server", "result"],
)
SERVER_BYTES = Counter(
    "chunkstore_peer_server_bytes_total",
    "Chunk bytes a peer server sent (direction=out) or took in (direction=in), by data plane.",
    ["server", "plane", "direction"],
)
SERVER_LEASES = Gauge(
    "chunkstore_peer_server_leases",
    "Leases a peer server holds open.",
    ["server"],
)
SERVER_SESSIONS = Gauge(
    "chunkstore_peer_server_sessions",
    "Sessions a peer server holds open (at most its max_sessions).",
    ["server"],
)
SERVER_SESSIONS_EVICTED = Counter(
    "chunkstore_peer_server_sessions_evicted_total",
    "Sessions a peer server dropped to admit new ones, by cause (per_client: the client "
    "identity was at its cap; full: the server was at max_sessions).",
    ["server", "cause"],
)
CLIENT_SECONDS = Histogram(
    "chunkstore_peer_client_request_seconds",
    "Round trip of a peer request, by operation and plane.",
    ["op", "plane"],
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
CLIENT_BYTES = Counter(
    "chunkstore_peer_client_bytes_total",
    "Chunk bytes a peer client moved, by plane and direction.",
    ["plane", "direction"],
)
CLIENT_FAILURES = Counter(
    "chunkstore_peer_client_failures_total",
    "Peer requests that became misses (timeout, refused, transfer_failed, corrupt).",
    ["reason"],
)
