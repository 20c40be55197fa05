"""What a peer server counts: its ``stats`` counters and its ``chunkstore_peer_server_*`` metrics.

Both are bumped together, so the numbers ``chunkstore peers`` shows and the
ones Prometheus scrapes never disagree.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

from chunkstore.peer._metrics import PeerMetrics


class ClientSeries(Protocol):
    """The per-client chunk counts of a node service
    (:class:`chunkstore.node._clientseries.NodeClientSeries`)."""

    def attached(self, clients: Iterable[str]) -> None:
        """The clients attached now, by name."""
        ...

    def served(self, client: str, hits: int, misses: int) -> None:
        """Client ``client`` asked for ``hits + misses`` chunks."""
        ...

    def retire(self) -> int:
        """Drop the series of clients long gone. Returns how many."""
        ...


class ServerAccounting:
    """Counters of one peer server. Thread-safe.
    ``name`` gives the server's current name, known only once the socket is bound."""

    def __init__(
        self,
        metrics: PeerMetrics,
        name: Callable[[], str],
        *,
        client_series: ClientSeries | None = None,
    ) -> None:
        self.metrics = metrics
        """Where the ``chunkstore_peer_server_*`` metrics go."""
        self._name = name
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._clients: set[str] = set()
        self.client_series = client_series
        """The per-client chunk counts of a node service, bounded over detached clients.
        ``None`` for other servers, whose clients get no chunk counts of their own."""

    def count(self, what: str, n: int = 1) -> None:
        """Add ``n`` to the ``stats`` counter ``what``."""
        with self._lock:
            self._counts[what] += n

    def snapshot(self) -> dict[str, int]:
        """The ``stats`` counters now."""
        with self._lock:
            return dict(self._counts)

    def request(self, op: str) -> None:
        """One valid request of operation ``op`` within a session."""
        self.metrics.server_requests.labels(self._name(), op).inc()
        self.count(f"op_{op}")

    def reject(self, reason: str) -> None:
        """One message refused for ``reason`` (a protocol error code)."""
        self.count(f"rejected_{reason}")
        self.metrics.server_rejected.labels(self._name(), reason).inc()

    def served(self, hits: int, misses: int, plane: str, nbytes: int) -> None:
        """One fetch: ``hits`` chunks (``nbytes`` in all) sent over ``plane``, ``misses`` not."""
        self.count("chunks_hit", hits)
        self.count("chunks_missed", misses)
        self.count(f"bytes_out_{plane}", nbytes)
        name = self._name()
        self.metrics.server_chunks.labels(name, "hit").inc(hits)
        self.metrics.server_chunks.labels(name, "miss").inc(misses)
        self.metrics.server_bytes.labels(name, plane, "out").inc(nbytes)

    def taken_in(self, plane: str, nbytes: int, chunks: int) -> None:
        """One push: ``chunks`` chunks (``nbytes`` in all) written from ``plane``."""
        self.count(f"bytes_in_{plane}", nbytes)
        self.metrics.server_bytes.labels(self._name(), plane, "in").inc(nbytes)
        self.count("chunks_pushed", chunks)

    def leases_open(self, count: int) -> None:
        """The number of leases held open changed to ``count``."""
        self.metrics.server_leases.labels(self._name()).set(count)

    def sessions_open(self, count: int) -> None:
        """The number of sessions held open changed to ``count``."""
        self.metrics.server_sessions.labels(self._name()).set(count)

    def session_evicted(self, cause: str) -> None:
        """A session was dropped to admit a new one (``per_client`` or ``full``)."""
        self.count(f"sessions_evicted_{cause}")
        self.metrics.server_sessions_evicted.labels(self._name(), cause).inc()

    # --- node service: per client ---------------------------------------------------------

    def node_clients(self, attached: dict[str, int]) -> None:
        """The node clients now attached, as client name to connections.
        Clients that left lose their per-client lease gauge at once.
        They lose their chunk counts after a grace period, see :attr:`client_series`."""
        name = self._name()
        self.metrics.node_clients.labels(name).set(sum(attached.values()))
        with self._lock:
            gone, self._clients = self._clients - set(attached), set(attached)
        for client in gone:
            try:
                self.metrics.node_client_leases.remove(name, client)
            except KeyError:
                pass
        if self.client_series is not None:
            self.client_series.attached(attached)

    def client_leases(self, client: str, count: int) -> None:
        """Node client ``client`` now holds ``count`` leases."""
        self.metrics.node_client_leases.labels(self._name(), client).set(count)

    def client_served(self, client: str, hits: int, misses: int) -> None:
        """Node client ``client`` asked for ``hits + misses`` chunks."""
        if self.client_series is not None:
            self.client_series.served(client, hits, misses)
