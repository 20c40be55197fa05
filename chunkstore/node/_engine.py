"""An engine's cache when it attaches to its machine's node service.

:class:`NodeCache` answers the scheduler and the worker as
:class:`~chunkstore.tiering.ProcessCache` does. But host memory is the node
service's, from ``chunkstore serve --node``. Lookups and leases go over its
unix socket. Chunk bytes are copied straight between the device and the
service's shared pool. The service owns the policy, the tiers and the
write-behind. So this store has no tiers of its own and nothing to flush.

When the service is down every lookup is a miss and every save is dropped.
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
    """A slot of the node service's pool, reserved for one chunk this engine saves."""

    view: memoryview
    """The whole writable slot in this process's mapping of the pool."""
    reservation: NodeReservation
    """The service's reservation (committed or aborted by the store)."""


class _NodeHostView:
    """The node's host memory as the scheduler asks it (``contains``)."""

    def __init__(self, client: NodeClient) -> None:
        self._client = client

    def contains(self, key: ChunkKey) -> bool:
        return self._client.exists([key])[0]


class NodeCache:
    """Host memory of the node service, as an engine adapter uses it. Thread-safe.

    Raises :class:`~chunkstore.node.NodeRefused` when the service refuses this
    engine's model or chunk size. Its message is one line naming both sides. A
    service that is not running yet is not an error. Lookups miss until it is.
    """

    tiers: Sequence[Store] = ()
    """None of its own: the service's tiers stand behind its host memory."""
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
        """The open reads of :meth:`read_host`, by the identity of the view they yielded (it
        stays alive while its read is open, so the identity is not reused meanwhile)."""
        self._reads_lock = threading.Lock()

    # --- lookups ---------------------------------------------------------------------

    def host_run(self, keys: Sequence[ChunkKey], start: int = 0) -> int:
        """Index one past the last of the consecutive keys from ``start`` the node holds (in
        host memory, or in its tiers: it promotes them when they are read)."""
        return start + self.client.lookup(list(keys[start:]))

    def tier_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Nothing beyond the node: it looked in its tiers already."""
        return 0

    def submit_prefetch(self, keys: Sequence[ChunkKey]) -> Future[PrefetchResult]:
        """Nothing to prefetch here. Never asked, as there are no tiers of our own."""
        done: Future[PrefetchResult] = Future()
        done.set_result(PrefetchResult())
        return done

    # --- data ------------------------------------------------------------------------

    @contextmanager
    def read_host(self, key: ChunkKey) -> Iterator[Any | None]:
        """The chunk's bytes in the node's pool, pinned by the service meanwhile."""
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
        """Whether the slot ``data`` lies in still held the leased chunk. The service holds
        the pins for us. It takes them back when our session ends, as on a dropped
        connection or a restarted service. After that the slot may be reused under a copy
        in flight."""
        with self._reads_lock:
            read = self._reads.get(id(data))
        if read is None:
            return _unknown_read  # not a read of ours that is still open: nothing vouches
        return functools.partial(self.client.still_valid, read, 0)

    def save_slot(self, save: ChunkIdentity) -> SaveSlot | None:
        """A slot of the node's pool for the chunk, or None: the node holds it already, has
        no room, or is down (the save is dropped; a later request recomputes)."""
        reservation = self.client.reserve([save.key])
        view = reservation.views[0]
        return NodeSlot(view, reservation) if view is not None else None

    def save_done(self, save: ChunkIdentity, slot: SaveSlot) -> None:
        """Seal the chunk in its slot and commit it: the node checks and publishes it."""
        assert isinstance(slot, NodeSlot)
        seal_save(self.layout, slot.view, save)
        self.client.commit(slot.reservation, [self.layout.total_size])

    def save_abandoned(self, slot: SaveSlot) -> None:
        """Give the slot back unpublished."""
        assert isinstance(slot, NodeSlot)
        self.client.abort(slot.reservation)

    def drop(self, key: ChunkKey) -> None:
        """Forget a chunk that failed to load. The node deletes it from host memory."""
        self.client.delete([key])

    def flush(self, timeout: float | None = None) -> None:
        """Nothing: the node writes behind to its tiers itself."""

    def reset_host(self) -> None:
        """Nothing: the node's host memory is every engine's; one engine does not clear it."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.client.close()


class NodeRankCache(NodeCache):
    """A TP rank's side of an engine attached to a node service, for TP > 1.

    Every rank process attaches on its own. A save reserves the chunk as this
    rank's part, a :class:`~chunkstore.node.RankShare`. The ranks of the engine
    get one shared slot, and each writes its heads there. The service seals and
    publishes the chunk when the last part is committed. It needs the model's
    ``--spec`` for that. ``engine`` names the engine, the same on every rank. In
    vLLM that is ``kv_transfer_config.engine_id``. The service combines parts of
    one engine only. Loads read the rank's heads from the slot the service pins
    for it.
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
        """The engine's identity on the wire. It is the same on all its ranks."""

    def save_slot(self, save: ChunkIdentity) -> SaveSlot | None:
        """This rank's share of the chunk's shared slot, or None (held already, no room,
        the service cannot assemble TP chunks, or it is down)."""
        share = RankShare(self.rank, self.tp, [save.parent], [save.tokens], self.engine)
        reservation = self.client.reserve([save.key], part=share)
        view = reservation.views[0]
        return NodeSlot(view, reservation) if view is not None else None

    def save_done(self, save: ChunkIdentity, slot: SaveSlot) -> None:
        """This rank's heads are in place; the service seals the chunk after the last part."""
        assert isinstance(slot, NodeSlot)
        self.client.commit(slot.reservation, [self.layout.total_size])

    def drop(self, key: ChunkKey) -> None:
        """Nothing: the scheduler's side decides what the node forgets."""


def _unknown_read() -> bool:
    return False


__all__ = ["NodeCache", "NodeRankCache", "NodeRefused"]
