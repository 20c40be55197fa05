"""Engine caches kept in the machine's node service: NodeCache and NodeRankCache.

:class:`NodeCache` answers the scheduler and the worker as
:class:`~chunkstore.tiering.ProcessCache` does. But the node service owns the
host memory. ``chunkstore serve --node`` runs that service. Lookups and leases
go over its unix socket. Chunk bytes move straight between the device and the
service's shared pool. The service owns the policy, the tiers and the
write-behind. So this store has no tiers and nothing to flush.

While the service is down, lookups miss and saves are dropped.
The engine recomputes and keeps serving. It attaches again once the service
is back; see :class:`~chunkstore.node.NodeClient`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from chunkstore.backends import Store
from chunkstore.format import ChunkLayout
from chunkstore.hashing import ChunkKey
from chunkstore.node._client import (
    NodeClient,
    NodeRead,
    NodeRefused,
    NodeReservation,
    RankShare,
    engine_identity,
)
from chunkstore.tiering import ChunkIdentity, PrefetchResult, SaveSlot, seal_save

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeSlot:
    """A pool slot reserved for one chunk this engine saves."""

    view: memoryview
    """The whole writable slot in this process's mapping of the pool."""
    reservation: NodeReservation
    """The service's reservation, which the store commits or aborts."""


class _NodeHostView:
    """The node's host memory as the scheduler queries it."""

    def __init__(self, client: NodeClient) -> None:
        self._client = client

    def contains(self, key: ChunkKey) -> bool:
        return self._client.exists([key])[0]


class NodeCache:
    """The node service's host memory, for an engine adapter.

    The class is thread-safe.

    Raises :class:`~chunkstore.node.NodeRefused` when the service refuses this
    engine's model or chunk size. Its message is one line naming both sides. A
    service that is not running yet is not an error. Lookups miss until it is.
    """

    tiers: Sequence[Store] = ()
    """No tiers of its own; the service's tiers stand behind its host memory."""
    tiers_are_fast = True

    def __init__(self, endpoint: str, *, layout: ChunkLayout, client_name: str | None = None):
        self.layout = layout
        """The chunk layout of every chunk saved through :meth:`save_slot`."""
        self.client = NodeClient(
            endpoint,
            slot_size=layout.total_size,
            fingerprint=layout.fingerprint,
            chunk_tokens=layout.spec.chunk_tokens,
            client_name=client_name,
        )
        """The attachment to the service."""
        if not self.client.attach():
            log.warning(
                "chunkstore: node service %s is not answering: misses until it is", endpoint
            )
        self.host = _NodeHostView(self.client)
        self.closed = False
        self._reads: dict[int, NodeRead] = {}
        """The open reads of :meth:`read_host`, keyed by the identity of the view they yielded."""
        # The view stays alive while its read is open, so its identity is not reused.
        self._reads_lock = threading.Lock()

    # --- lookups ---------------------------------------------------------------------

    def host_run(self, keys: Sequence[ChunkKey], start: int = 0) -> int:
        """The end of the run of keys from ``start`` that the node holds.

        A key may be in host memory or in the node's tiers. Reads promote keys
        from its tiers.
        """
        return start + self.client.lookup(list(keys[start:]))

    def tier_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Return 0: the node looked in its tiers already."""
        return 0

    def submit_prefetch(self, keys: Sequence[ChunkKey]) -> Future[PrefetchResult]:
        """Prefetch nothing; with no tiers of our own, nobody asks."""
        done: Future[PrefetchResult] = Future()
        done.set_result(PrefetchResult())
        return done

    # --- data ------------------------------------------------------------------------

    @contextmanager
    def read_host(self, key: ChunkKey) -> Iterator[Any | None]:
        """The chunk's bytes in the node's pool, which the service pins meanwhile."""
        read: NodeRead = self.client.acquire([key])
        view = read.views[0]
        if view is not None:
            with self._reads_lock:
                self._reads[id(view)] = read
        try:
            yield view
        finally:
            if view is not None:
                with self._reads_lock:
                    self._reads.pop(id(view), None)
            self.client.release(read)

    def read_check(self, data: Any) -> Callable[[], bool] | None:
        """Whether the slot under ``data`` still held the leased chunk.

        The service holds the pins for us. It takes them back when our session
        ends. A dropped connection or a restarted service ends it. The slot may
        then be reused under a copy in flight.
        """
        with self._reads_lock:
            read = self._reads.get(id(data))
        if read is None:
            return _unknown_read  # not a read of ours that is still open: nothing vouches
        return functools.partial(self.client.still_valid, read, 0)

    def save_slot(self, save: ChunkIdentity) -> SaveSlot | None:
        """A slot of the node's pool for the chunk, or None.

        The node may hold the chunk already, have no room or be down. The save
        is then dropped. A later request recomputes the chunk.
        """
        reservation = self.client.reserve([save.key])
        view = reservation.views[0]
        return NodeSlot(view, reservation) if view is not None else None

    def save_done(self, save: ChunkIdentity, slot: SaveSlot) -> None:
        """Seal the chunk in its slot and commit it; the node checks and publishes it."""
        assert isinstance(slot, NodeSlot)
        seal_save(self.layout, slot.view, save)
        self.client.commit(slot.reservation, [self.layout.total_size])

    def save_abandoned(self, slot: SaveSlot) -> None:
        """Give the slot back unpublished."""
        assert isinstance(slot, NodeSlot)
        self.client.abort(slot.reservation)

    def drop(self, key: ChunkKey) -> None:
        """Forget a chunk that failed to load; the node deletes it."""
        self.client.delete([key])

    def flush(self, timeout: float | None = None) -> None:
        """Return at once: the node writes behind itself."""

    def reset_host(self) -> None:
        """Do nothing: the node's host memory serves every engine."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.client.close()


class NodeRankCache(NodeCache):
    """A TP rank's side of an engine on a node service, at TP > 1.

    Every rank process attaches on its own. A save reserves the chunk as this
    rank's part, a :class:`~chunkstore.node.RankShare`. The engine's ranks get
    one shared slot. Each writes its heads there. The service seals and
    publishes the chunk once the last part is committed. For that it needs the
    model's ``--spec``. ``engine`` names the engine, the same on every rank.
    In vLLM it is ``kv_transfer_config.engine_id``. The service combines parts
    of one engine only. On loads, the service pins a slot. The rank reads its
    heads from it.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        layout: ChunkLayout,
        rank: int,
        tp: int,
        engine: str,
        client_name: str | None = None,
    ) -> None:
        super().__init__(endpoint, layout=layout, client_name=client_name)
        self.rank = rank
        self.tp = tp
        self.engine = engine_identity(engine)
        """The engine's identity on the wire, the same on all its ranks."""

    def save_slot(self, save: ChunkIdentity) -> SaveSlot | None:
        """This rank's share of the chunk's shared slot, or None.

        The chunk may be held already, or there is no room. Or the service is
        down, or cannot assemble TP chunks.
        """
        share = RankShare(self.rank, self.tp, [save.parent], [save.tokens], self.engine)
        reservation = self.client.reserve([save.key], part=share)
        view = reservation.views[0]
        return NodeSlot(view, reservation) if view is not None else None

    def save_done(self, save: ChunkIdentity, slot: SaveSlot) -> None:
        """Mark this rank's heads in place.

        The service seals the chunk after the last part.
        """
        assert isinstance(slot, NodeSlot)
        self.client.commit(slot.reservation, [self.layout.total_size])

    def drop(self, key: ChunkKey) -> None:
        """Do nothing: the scheduler's side decides what the node forgets."""


def _unknown_read() -> bool:
    return False


__all__ = ["NodeCache", "NodeRankCache", "NodeRefused"]
