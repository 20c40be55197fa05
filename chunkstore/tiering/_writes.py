"""Writes from host memory to a tiered store's secondary tiers.

Write-behind: a chunk committed to host memory is queued, still pinned in its
slot. A :class:`~chunkstore.tiering._writeback.WriteBehindQueue` drains the
queue on its thread. It writes chunks to the target tiers in batches and reads
the slots in place. A full queue drops the write. It never blocks the caller
or grows memory. Each drop is counted per tier as ``queue_full`` and logged
with the key.

Write-through: :meth:`TierWriter.write_through` writes a chunk that host
memory cannot take. It goes to the target tiers at once.

Both start the write on every target tier at once, through
:meth:`~chunkstore.tiering._tierlist.TierList.start_writes`. A write that times
out may still be reading its memory. So a write-back batch stays pinned until
every such call has ended. A write-through hands the tiers a private copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from chunkstore.backends.base import Buffer
from chunkstore.cache._host import HostCache
from chunkstore.cache._lease import Lease
from chunkstore.events import ChunkListener
from chunkstore.hashing import ChunkKey
from chunkstore.tiering._guard import GuardedTier, TierUnavailable
from chunkstore.tiering._tierlist import TierList, TierWrites
from chunkstore.tiering._writeback import WriteBehindQueue

log = logging.getLogger(__name__)

RECENT_DROPS = 100
"""How many dropped keys :meth:`TierWriter.dropped_keys` remembers."""
DROP_LOG_INTERVAL = 10.0
"""Seconds between two warnings about dropped writes; drops in between are counted."""


class TierWriter:
    """Writes chunks of ``host`` to ``targets``, queued behind the caller or at once.

    With no targets nothing is queued. A lease to queue is released at once.
    ``name`` is the owning store's name, for thread names and log lines.
    """

    def __init__(
        self,
        host: HostCache,
        targets: Sequence[GuardedTier],
        *,
        queue_size: int,
        write_batch: int,
        name: str,
    ) -> None:
        self._host = host
        self._tiers = TierList(targets)
        self._name = name
        self.capacity = queue_size if self._tiers else 0
        """Most chunks that may wait; 0 without targets."""
        self._queue: WriteBehindQueue[Lease] | None = (
            WriteBehindQueue(
                self._write_back,
                capacity=queue_size,
                batch_size=write_batch,
                name=f"chunkstore-writeback-{name}",
                undo=self._undo_writes,
            )
            if self._tiers
            else None
        )
        self._lock = threading.Lock()
        self._recent_drops: deque[ChunkKey] = deque(maxlen=RECENT_DROPS)
        self._drops_unreported = 0
        self._last_drop_log = float("-inf")
        self.listener: ChunkListener | None = None
        """The listener told of each chunk a write here stored in a tier."""
        # It is not told of a chunk the tier already had.

    # --- reporting ------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Chunks waiting, not counting the batch being written."""
        return self._queue.depth if self._queue else 0

    @property
    def pending(self) -> int:
        """Chunks waiting or being written."""
        return self._queue.pending if self._queue else 0

    def dropped_keys(self) -> list[ChunkKey]:
        """The latest chunks whose write-back was dropped, oldest first."""
        with self._lock:
            return list(self._recent_drops)

    # --- write-behind ---------------------------------------------------------------------

    def enqueue(self, lease: Lease) -> None:
        """Queue the chunk under ``lease``, a pinned read lease, for write-back.

        The writer takes over the lease.
        """
        if self._queue is None:
            self._host.release(lease)
            return
        if self._queue.offer(lease):
            return
        self._host.release(lease)
        for tier in self._tiers:
            tier.count_drop("queue_full")
        self._report_drop(lease.key, "write-behind queue full")

    def withdraw(self, keys: Sequence[ChunkKey]) -> None:
        """Take back the queued write-backs of ``keys`` without waiting for the queue.

        A write-back of one of them may already be under way. It is undone when
        it ends: the keys are deleted again from the targets.
        """
        if self._queue is None:
            return
        wanted = set(keys)
        for lease in self._queue.withdraw(lambda lease: lease.key in wanted):
            self._host.release(lease)

    def deleted_in_flight(self, key: ChunkKey) -> bool:
        """Whether ``key`` was deleted during its write-back, and the undo has not ended.

        Its copy in the tiers is then on its way out. It must never be promoted.
        """
        if self._queue is None:
            return False
        return self._queue.undo_pending(lambda lease: lease.key == key)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back is done; False if ``timeout`` passed first."""
        return self._queue.flush(timeout) if self._queue else True

    def close(self) -> None:
        """Write what is queued and stop the drain thread."""
        if self._queue is not None:
            for lease in self._queue.close():
                self._host.release(lease)

    def _write_back(self, batch: list[Lease]) -> None:
        """Write a batch to the target tiers on the drain thread, then unpin it.

        The tiers read the slots in place, with no copy on the common path. A
        write that times out may still be reading them. So the batch stays
        pinned until every such call has ended. Until then no other chunk can
        reuse the slots and have its bytes stored under these keys.
        """

        def release_batch() -> None:
            for lease in batch:
                self._host.release(lease)

        holds = _Holds(release_batch)
        try:
            items: list[tuple[ChunkKey, Buffer]] = [(lease.key, lease.view) for lease in batch]
            nbytes = sum(len(lease.view) for lease in batch)
            self._write_all(items, nbytes, if_absent=False, holds=holds)
        finally:
            holds.done()

    def _undo_writes(self, batch: list[Lease]) -> None:
        """Undo, on the drain thread, writes of keys deleted during their write-back."""
        keys = list(dict.fromkeys(lease.key for lease in batch))
        for tier in self._tiers:
            try:
                tier.call("delete", tier.store.delete_many, keys)
            except TierUnavailable:
                continue

    # --- write-through --------------------------------------------------------------------

    def write_through(self, key: ChunkKey, data: Buffer, *, if_absent: bool) -> bool:
        """Write a chunk that host memory could not take to the target tiers now."""
        view: Buffer = memoryview(data).cast("B")
        if any(tier.timeout is not None for tier in self._tiers):
            # A call that times out goes on reading its input after we return. The caller may
            # reuse its buffer meanwhile. So hand the tiers a private copy; this is the slow path.
            view = bytes(view)
        return self._write_all([(key, view)], len(view), if_absent=if_absent)

    def supersede(self, key: ChunkKey) -> None:
        """Prepare to write ``key`` around host memory.

        Drop the older copy host memory may still hold. Its slot was pinned for
        write-back, so it could not be replaced. Take back its queued
        write-back. Let one under way end first. Otherwise reads, and later the
        tiers, would go back to the older bytes.
        """
        self._host.delete_many([key])
        if self._queue is None:
            return
        known = [t.timeout for t in self._tiers if t.timeout is not None]
        bound = max(known) if known and len(known) == len(self._tiers) else None
        for lease in self._queue.supersede(lambda lease: lease.key == key, bound):
            self._host.release(lease)

    # --- both -----------------------------------------------------------------------------

    def _write_all(
        self,
        items: list[tuple[ChunkKey, Buffer]],
        nbytes: int,
        *,
        if_absent: bool,
        holds: _Holds | None = None,
    ) -> bool:
        """Write ``items`` to every target tier at once; return whether some tier stored them.

        ``holds`` keeps their memory alive past a timeout. Without it, the
        buffers must be private to this write. A timed-out call may read them
        later.
        """
        writes = self._tiers.start_writes(
            TierWrites(len(items), nbytes, if_absent=if_absent), items
        )
        stored = False
        for tier, written, why in writes.settle(holds.until_settled if holds else None):
            if written is None:
                text = (
                    f"tier {tier.name} is down"
                    if why == "tier_down"
                    else f"write to {tier.name} failed"
                )
                for key, _ in items:
                    self._report_drop(key, text)
                continue
            if self.listener is not None:
                for (key, _), ok in zip(items, written, strict=True):
                    if ok:
                        self.listener.chunk_stored(key, tier.name)
            if not if_absent:
                # A plain put answers False for an item it could not store, such as S3 after its
                # retries or a failed NIXL write. That write-back is lost, so count it. For
                # put_if_absent, False means the tier already had the chunk.
                failed = [key for (key, _), ok in zip(items, written, strict=True) if not ok]
                if failed:
                    tier.count_drop("tier_error", len(failed))
                    for key in failed:
                        self._report_drop(key, f"{tier.name} did not store it")
            stored = stored or any(written)
        return stored

    def _report_drop(self, key: ChunkKey, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._recent_drops.append(key)
            self._drops_unreported += 1
            if now - self._last_drop_log < DROP_LOG_INTERVAL:
                return
            count, self._drops_unreported = self._drops_unreported, 0
            self._last_drop_log = now
        log.warning(
            "%s: dropped write-back of %s (%s); %d dropped since the last report",
            self._name,
            key.hex,
            why,
            count,
        )


class _Holds:
    """Releases a write-back batch once the drain thread and all abandoned writes are done."""

    __slots__ = ("_count", "_lock", "_release")

    def __init__(self, release: Callable[[], None]) -> None:
        self._count = 1
        self._lock = threading.Lock()
        self._release = release

    def until_settled(self, failure: TierUnavailable) -> None:
        """Keep the batch until the call behind ``failure`` has ended, if it still runs."""
        if failure.pending is None:
            return
        with self._lock:
            self._count += 1
        failure.when_settled(self.done)

    def done(self) -> None:
        """One holder fewer; the last one releases."""
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._release()
