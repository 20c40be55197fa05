"""A node service's per-client chunk counts, bounded however many engines come and go.

``chunkstore_node_client_chunks_total{server,client,result}`` has one series per
engine name. Engines are often short-lived: a restart, an autoscaled replica, a
test run. So the series of engines that detached must not stay for ever. But
removing a series when its engine detaches would lose the counts it gained
since the last scrape. So a detached engine's series are kept for a grace
period of :data:`DETACHED_GRACE_S`, several scrape intervals. They are kept for
at most :data:`MAX_DETACHED_CLIENTS` engines at once, and the oldest go first.
Then their counts are added to the ``client="detached"`` series, and theirs are
removed. Summed over ``client``, every count only grows. What leaves one series
arrives in ``detached`` in the same step.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from chunkstore.peer._metrics import PeerMetrics

DETACHED = "detached"
"""The ``client`` label of the counts of engines whose own series were retired."""
DETACHED_GRACE_S = 300.0
"""Seconds a detached engine's series stay. Its last counts get scraped meanwhile."""
MAX_DETACHED_CLIENTS = 64
"""Detached engines whose series are kept at once; beyond, the oldest are retired early."""
RESULTS = ("hit", "miss")


class NodeClientSeries:
    """The ``chunkstore_node_client_chunks_total`` series of one node service; thread-safe.

    ``server`` gives the service's current name, the ``server`` label. ``clock`` is
    monotonic seconds; tests pass a fake one.
    """

    def __init__(
        self,
        metrics: PeerMetrics,
        server: Callable[[], str],
        *,
        grace_s: float = DETACHED_GRACE_S,
        max_detached: int = MAX_DETACHED_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._server = server
        self._grace_s = grace_s
        self._max_detached = max_detached
        self._clock = clock
        self._attached: set[str] = set()
        self._detached: OrderedDict[str, float] = OrderedDict()
        """Detached engines whose series are still kept, oldest first: when they detached."""
        self._counts: dict[tuple[str, str], int] = {}
        """What each kept series holds. A retired engine's series add this to ``detached``."""
        self._lock = threading.Lock()

    def attached(self, clients: Iterable[str]) -> None:
        """Set the engines attached now, by name. Those that left start their grace period.
        Those back within it keep their series."""
        now = self._clock()
        current = set(clients)
        with self._lock:
            for client in self._attached - current:
                if client != DETACHED:
                    self._detached[client] = now
                    self._detached.move_to_end(client)
            for client in current:
                self._detached.pop(client, None)
            self._attached = current
            self._retire(now)

    def served(self, client: str, hits: int, misses: int) -> None:
        """Engine ``client`` asked for ``hits + misses`` chunks."""
        with self._lock:
            # A count that arrives after its engine's series were retired (a request still
            # in flight when it detached) goes where its earlier counts went.
            label = client if client in self._attached or client in self._detached else DETACHED
            self._add(label, "hit", hits)
            self._add(label, "miss", misses)

    def retire(self) -> int:
        """Retire the detached engines past their grace period or beyond the bound. Returns
        how many. Also done on every change of the attached engines."""
        with self._lock:
            return self._retire(self._clock())

    def _retire(self, now: float) -> int:
        retired = 0
        while self._detached:
            client, since = next(iter(self._detached.items()))
            if len(self._detached) <= self._max_detached and now - since < self._grace_s:
                break
            del self._detached[client]
            server = self._server()
            for result in RESULTS:
                count = self._counts.pop((client, result), 0)
                if count:
                    self._add(DETACHED, result, count)
                try:
                    self._metrics.node_client_chunks.remove(server, client, result)
                except KeyError:
                    pass
            retired += 1
        return retired

    def _add(self, client: str, result: str, n: int) -> None:
        """Count ``n`` in the series. The caller holds the lock, so a retirement never runs
        between the tally and the series."""
        key = (client, result)
        self._counts[key] = self._counts.get(key, 0) + n
        self._metrics.node_client_chunks.labels(self._server(), client, result).inc(n)


__all__ = ["DETACHED", "DETACHED_GRACE_S", "MAX_DETACHED_CLIENTS", "NodeClientSeries"]
