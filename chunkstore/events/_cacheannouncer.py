"""Announce what one host cache holds, as it changes. These are the node service's events.

:class:`CacheAnnouncer` listens to a :class:`~chunkstore.cache.HostCache`
through its ``listener`` attribute. That is the hook the tiered store's
``watch`` sets. It publishes the changes on an :class:`EventPublisher`.
``BlockStored`` says a chunk was published in host memory. The chunk may be
written by an engine, sealed from TP ranks' parts, or promoted from a tier.
``BlockRemoved`` says the cache evicted or deleted it. The announcer starts
with ``AllBlocksCleared``, then announces what the cache holds already. It
ends with ``AllBlocksCleared``, because the pool goes with it.

Events name chunks as the shared-store announcer does:

* ``block_hashes`` is the chunk's 32-byte key.
* ``parent_block_hash`` is its parent's. For a first chunk it is the namespace
  root.
* ``token_ids`` are the tokens it covers, read from the chunk's header.
* ``block_size`` is their number.
* ``extra_keys`` carries ``("namespace", <16 hex digits>)``.

``medium`` is ``CPU``, ``locality`` ``LOCAL`` and ``ownership`` ``node``. That
is the host cache every engine of the machine shares.

The listener only queues, because it runs with the cache's lock held. A thread
publishes every ``interval`` seconds. Changes to one chunk between two
publications are folded into its latest state. If the queue overflowed,
the announcer starts over: ``AllBlocksCleared``, then the listing.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from chunkstore.errors import FormatError
from chunkstore.events._publisher import EventPublisher
from chunkstore.events._records import EventBuffer
from chunkstore.events._wire import EventBatch, all_blocks_cleared, block_removed, block_stored
from chunkstore.hashing import ChunkKey

__all__ = ["NODE_OWNERSHIP", "CacheAnnouncer"]

NODE_OWNERSHIP = "node"
"""``ownership`` of the node service's events: the host cache of one machine's engines."""
MEDIUM = "CPU"
STORED, REMOVED = "BlockStored", "BlockRemoved"
LOCALITY = "LOCAL"


class CacheAnnouncer:
    """Publishes what the host cache ``host`` stores and drops on ``publisher``.

    At most ``capacity`` changes wait between two publications. Beyond that the
    announcer starts over; see :attr:`resyncs`. ``page`` events go in one batch.
    """

    def __init__(
        self,
        host: Any,
        publisher: EventPublisher,
        *,
        interval: float = 0.05,
        page: int = 512,
        capacity: int = 65536,
        ownership: str = NODE_OWNERSHIP,
    ) -> None:
        self.host = host
        self.publisher = publisher
        self.interval = interval
        self.page = page
        self.ownership = ownership
        self.resyncs = 0
        """Times the change queue overflowed and everything was announced again."""
        self.unreadable = 0
        """Chunks stored but gone (or not a chunk) by the time their header was read: not
        announced; their removal is not either."""
        self._buffer = EventBuffer(capacity)
        self._dropped_seen = 0
        self._held: set[ChunkKey] = set()
        self._previous: Any = None
        self._pass = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False

    @property
    def held(self) -> int:
        """Chunks announced as stored, and not since as removed."""
        return len(self._held)

    # --- the listener (called with the cache's lock held: queue only) ------------------

    def chunk_stored(self, key: ChunkKey, where: str) -> None:
        if where == self.host.name:
            self._buffer.chunk_stored(key, where)
        if self._previous is not None:
            self._previous.chunk_stored(key, where)

    def chunk_removed(self, key: ChunkKey, where: str) -> None:
        if where == self.host.name:
            self._buffer.chunk_removed(key, where)
        if self._previous is not None:
            self._previous.chunk_removed(key, where)

    # --- publishing --------------------------------------------------------------------

    def start(self) -> CacheAnnouncer:
        """Listen, announce ``AllBlocksCleared`` and what the cache holds, then publish the
        changes every ``interval`` seconds on a thread, until :meth:`close`."""
        self._previous = self.host.listener
        self.host.listener = self  # before the listing: nothing stored meanwhile is missed
        with self._pass:
            self._started = True
            self._resync()
        self._thread = threading.Thread(
            target=self._run, name="chunkstore-cache-announcer", daemon=True
        )
        self._thread.start()
        return self

    def pump(self) -> tuple[int, int]:
        """Publish the changes queued since the last call; (stored, removed) announced."""
        with self._pass:
            if not self._started:
                return 0, 0
            dropped = self._buffer.dropped
            if dropped != self._dropped_seen:
                self._dropped_seen = dropped
                self.resyncs += 1
                self._buffer.take()
                return self._resync()
            latest: dict[ChunkKey, bool] = {}
            for change in self._buffer.take():
                latest.pop(change.key, None)  # ordered by each chunk's last change
                latest[change.key] = change.stored
            sent = self._publish_pages(self._changes(latest))
            return sent[STORED], sent[REMOVED]

    def _changes(self, latest: dict[ChunkKey, bool]) -> Iterator[dict[str, Any]]:
        """The event of each chunk's latest change, where it changes what was announced."""
        for key, is_stored in latest.items():
            if is_stored and key not in self._held:
                event = self._describe(key)
                if event is None:
                    continue
                self._held.add(key)
                yield event
            elif not is_stored and key in self._held:
                self._held.discard(key)
                yield self._removed(key)
            # else: a replaced copy, or a chunk never announced

    def _resync(self) -> tuple[int, int]:
        """``AllBlocksCleared``, then every chunk the cache holds. The caller holds ``_pass``."""
        self._held.clear()
        self._publish([all_blocks_cleared()])
        return self._publish_pages(self._listing())[STORED], 0

    def _listing(self) -> Iterator[dict[str, Any]]:
        """A ``BlockStored`` for each chunk the cache holds, marking each as held."""
        for info in self.host.list():
            event = self._describe(info.key)
            if event is not None:
                self._held.add(info.key)
                yield event

    def _publish_pages(self, events: Iterable[dict[str, Any]]) -> Counter[str]:
        """Publish ``events`` in batches of ``page``, the last one shorter, as they come.
        Returns how many of each type were published."""
        sent: Counter[str] = Counter()
        iterator = iter(events)
        while page := list(itertools.islice(iterator, self.page)):
            self._publish(page)
            sent.update(event["type"] for event in page)
        return sent

    def _describe(self, key: ChunkKey) -> dict[str, Any] | None:
        """The ``BlockStored`` of a cached chunk, from its header (None: gone or not a chunk)."""
        from chunkstore.format import read_header

        # Only the header's bytes are copied out of the slot, not the payload. Not a use of
        # the chunk either: no hit is counted and the replacement policy is not told.
        data = self.host.read_headers_unchecked_many([key])[0]
        if data is None:
            self.unreadable += 1
            return None
        try:
            header = read_header(data)
        except FormatError:
            self.unreadable += 1
            return None
        if header.key != key.digest:
            self.unreadable += 1
            return None
        tokens = list(header.tokens)
        return block_stored(
            [key.digest],
            header.parent,
            tokens,
            len(tokens),
            MEDIUM,
            extra_keys=[("namespace", key.namespace)],
            locality=LOCALITY,
            ownership=self.ownership,
        )

    def _removed(self, key: ChunkKey) -> dict[str, Any]:
        return block_removed([key.digest], MEDIUM, locality=LOCALITY, ownership=self.ownership)

    def _publish(self, events: list[dict[str, Any]]) -> None:
        self.publisher.publish(EventBatch(time.time(), events))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.pump()
            except Exception:  # noqa: BLE001 - a failed pass is retried next time
                continue

    def close(self) -> None:
        """Publish what is queued, stop listening, and announce ``AllBlocksCleared``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 5)
        if self.host.listener is self:
            self.host.listener = self._previous
        if not self._started:
            return
        try:
            self.pump()
        except Exception:  # noqa: BLE001 - closing goes on: the clear below says it all
            pass
        with self._pass:
            self._started = False
            self._held.clear()
            self._publish([all_blocks_cleared()])
