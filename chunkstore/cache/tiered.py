"""TieredStore: the host cache in front of secondary tiers, as one store.

* ``put``: the chunk goes into host memory first (the caller's copy is then
  done) and is queued, still pinned in its host slot, for a background write to
  the secondary tiers: every tier (``write_tiers="all"``) or the first only
  (``"first"``). A full queue drops the write (counted per tier as
  ``queue_full``, logged with the key) rather than block the caller or grow
  memory. If host memory cannot take the chunk (every slot pinned, or the chunk
  is larger than a slot) it is written to the tiers synchronously instead.
* ``get`` / ``get_into`` / ``acquire``: the first tier that has the chunk, host
  first; a hit in a lower tier is copied into host memory (promotion).
* ``lookup_prefix``: host index first, then each tier (batched) from where the
  previous one stopped, until a full pass over the tiers adds nothing.
* ``prefetch`` / ``lookup_prefix_async``: the same walk on a background thread,
  returning a future (never failing: a tier error only shortens the result);
  ``prefetch`` also copies the chunks it finds into host memory and reports
  where each came from.
* A tier that raises or times out is a miss (reads) or a dropped write, and is
  retried after ``retry_after`` seconds; the caller never sees its exception.
  A timed-out call keeps running in the background, so host memory handed to
  it (a slot being promoted into, a slot being written back) stays pinned
  until it ends; a caller's own buffer is never handed to a call that may
  outlive it (a private copy is used instead).
* ``delete`` never waits for the write-behind queue: queued write-backs of the
  deleted keys are withdrawn, and a write already under way is undone (the
  keys deleted again from the tiers) when it ends.
* Eviction never loses a chunk waiting for write-back (its slot is pinned
  until written); :meth:`TieredStore.close` flushes the queue. A crash loses at
  most the queued chunks, and only the host copy of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from chunkstore.backends.base import (
    Buffer,
    ChunkInfo,
    Store,
    SupportsGetInto,
    SupportsGetManyInto,
)
from chunkstore.cache.guard import GuardedTier, TierUnavailable
from chunkstore.cache.host import HostCache, HostCacheStats, Lease
from chunkstore.cache.writeback import WriteBehindQueue
from chunkstore.errors import ConfigError, FormatError
from chunkstore.format import read_header, recompress
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics, default_metrics

log = logging.getLogger(__name__)

R = TypeVar("R")

HOST_SOURCE = "host"
"""What :meth:`TieredStore.prefetch` reports for a chunk that was already in host memory."""

WRITE_TIERS = ("all", "first")
"""``write_tiers`` values: write-through to every secondary tier, or only the first."""


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one secondary tier."""

    name: str
    """The tier's store name (its metric label)."""
    hits: int
    """Chunks this tier served (after every tier above it missed)."""
    misses: int
    """Chunks asked of this tier that it did not have (or could not serve)."""
    promotions: int
    """Chunks copied from this tier into host memory."""
    writes: int
    """Chunks written into this tier."""
    dropped: dict[str, int]
    """Writes to this tier not performed, by reason (queue_full, tier_down, tier_error)."""
    errors: int
    """Calls that failed or timed out."""
    up: bool
    """False while the tier is in back-off."""
    abandoned: int = 0
    """Timed-out calls still running; each may keep a host slot pinned until it ends."""


@dataclass(frozen=True, slots=True)
class TieredStats:
    """A snapshot of a tiered store's counters."""

    host: HostCacheStats
    """The host cache's own counters."""
    tiers: tuple[TierStats, ...]
    """One entry per secondary tier, in lookup order."""
    queue_depth: int
    """Chunks waiting for write-back."""
    writes_dropped: int
    """All dropped writes over all tiers and reasons."""


@dataclass(frozen=True, slots=True)
class TieredHealth:
    """What the metrics collector reads at scrape time."""

    queue_depth: int
    """Chunks waiting for write-back."""
    queue_capacity: int
    """Most chunks that may wait."""
    tiers_up: tuple[tuple[str, bool], ...]
    """(tier name, answering?) per secondary tier."""


class TieredStore(Store):
    """A :class:`HostCache` in front of secondary stores; see the module docstring.

    The tiered store owns ``host`` and (with ``close_tiers``) the tiers, and
    closes them in :meth:`close`. ``tier_timeout=None`` calls tiers inline
    (no timeout thread); ``clock`` exists for tests of the back-off.
    ``prefetch_workers``: threads serving :meth:`prefetch` and
    :meth:`lookup_prefix_async` (started on first use).

    ``verify`` checks chunks served from host memory (a corrupt one is counted
    and deleted from every tier). Off by default: host memory is trusted, and
    every secondary tier checks what it returns with its own ``verify``.
    """

    kind = "tiered"

    def __init__(
        self,
        host: HostCache,
        tiers: Sequence[Store] = (),
        *,
        write_tiers: str = "all",
        queue_size: int = 256,
        write_batch: int = 16,
        tier_timeout: float | None = 30.0,
        retry_after: float = 5.0,
        promote: bool = True,
        close_tiers: bool = True,
        metrics: ChunkstoreMetrics | None = None,
        name: str | None = None,
        verify: bool = False,
        clock: Callable[[], float] = time.monotonic,
        prefetch_workers: int = 2,
    ) -> None:
        super().__init__(name=name, verify=verify)
        if prefetch_workers < 1:
            raise ConfigError(f"prefetch_workers must be >= 1, got {prefetch_workers}")
        if write_tiers not in WRITE_TIERS:
            raise ConfigError(f"write_tiers must be one of {WRITE_TIERS}, got {write_tiers!r}")
        if tier_timeout is not None and tier_timeout <= 0:
            raise ConfigError(f"tier_timeout must be positive (or None), got {tier_timeout}")
        if retry_after < 0:
            raise ConfigError(f"retry_after must be >= 0, got {retry_after}")
        names = [host.name, *(t.name for t in tiers)]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique (they label metrics): {names}")
        self.host = host
        """Tier 0."""
        self.metrics = metrics or default_metrics()
        """Where this store's metrics go."""
        self.write_tiers = write_tiers
        """``"all"`` or ``"first"``."""
        self.promote = promote
        """Whether hits in lower tiers are copied into host memory."""
        self.close_tiers = close_tiers
        self._host_metrics = self.metrics.tier(host.name)
        self.tiers: tuple[GuardedTier, ...] = tuple(
            GuardedTier(
                t,
                self.metrics.tier(t.name),
                timeout=tier_timeout,
                retry_after=retry_after,
                clock=clock,
            )
            for t in tiers
        )
        """Secondary tiers in lookup order."""
        self._targets = self.tiers[:1] if write_tiers == "first" else self.tiers
        self._queue: WriteBehindQueue[Lease] | None = (
            WriteBehindQueue(
                self._write_back,
                capacity=queue_size,
                batch_size=write_batch,
                name=f"chunkstore-writeback-{self.name}",
                undo=self._undo_writes,
            )
            if self._targets
            else None
        )
        self._queue_size = queue_size
        self._recent_drops: deque[ChunkKey] = deque(maxlen=100)
        self._lock = threading.Lock()
        self._drops_unreported = 0
        self._last_drop_log = float("-inf")
        self._closed = False
        self._prefetch_workers = prefetch_workers
        self._background: ThreadPoolExecutor | None = None
        self.metrics.watch_host(host)
        self.metrics.watch_store(host)
        for tier in tiers:
            self.metrics.watch_store(tier)
        self.metrics.watch_tiered(self)

    # --- reporting ------------------------------------------------------------------------

    def stats(self) -> TieredStats:
        """Counters of the host cache and every tier."""
        tiers = tuple(
            TierStats(
                t.name,
                t.hits,
                t.misses,
                t.promotions,
                t.writes,
                dict(t.dropped),
                t.errors,
                t.up,
                t.abandoned,
            )
            for t in self.tiers
        )
        return TieredStats(
            host=self.host.stats(),
            tiers=tiers,
            queue_depth=self._queue.pending if self._queue else 0,
            writes_dropped=sum(sum(t.dropped.values()) for t in tiers),
        )

    def health(self) -> TieredHealth:
        """Queue depth and tier liveness (for the metrics collector)."""
        return TieredHealth(
            queue_depth=self._queue.depth if self._queue else 0,
            queue_capacity=self._queue_size if self._queue else 0,
            tiers_up=tuple((t.name, t.up) for t in self.tiers),
        )

    def dropped_keys(self) -> list[ChunkKey]:
        """The most recent (up to 100) chunks whose write-back was dropped, oldest first."""
        with self._lock:
            return list(self._recent_drops)

    @property
    def corrupt_detected(self) -> int:
        """Corrupt chunks found in host memory (with ``verify``) and by every tier."""
        return (
            self._corrupt
            + self.host.corrupt_detected
            + sum(t.store.corrupt_detected for t in self.tiers)
        )

    def _quarantine(self, key: ChunkKey, reason: str) -> None:
        # A chunk found corrupt in host memory went to the tiers from the same bytes.
        self.delete_many([key])

    # --- writes ---------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._check_open()
        return [self._put_one(key, data, if_absent=False) for key, data in items]

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._check_open()
        if not items:
            return []
        present = self.exists_many([k for k, _ in items])
        # The host cache settles races between concurrent callers: its insert is atomic.
        return [
            False if found else self._put_one(key, data, if_absent=True)
            for (key, data), found in zip(items, present)
        ]

    def _put_one(self, key: ChunkKey, data: Buffer, *, if_absent: bool) -> bool:
        started = time.perf_counter()
        outcome = self.host.insert(key, data, if_absent=if_absent, keep_pinned=True)
        if outcome.present:
            return False
        if outcome.lease is None:
            if not if_absent:
                self._supersede(key)
            return self._write_through(key, data, if_absent=if_absent)
        self._host_metrics.record_write(len(outcome.lease.view), time.perf_counter() - started)
        self._queue_write_back(outcome.lease)
        return True

    def reserve(self, key: ChunkKey) -> Lease | None:
        """A pinned writable host slot for ``key`` (see :meth:`HostCache.reserve`).

        ``None`` when every slot is pinned: fall back to :meth:`put` with a
        buffer of your own. Finish with :meth:`commit` or :meth:`abort`.
        """
        self._check_open()
        return self.host.reserve(key)

    def commit(self, lease: Lease, length: int | None = None) -> None:
        """Publish a reserved slot in host memory and queue its write-back."""
        self.host.commit(lease, length, keep_pinned=True)
        self._queue_write_back(lease)

    def abort(self, lease: Lease) -> None:
        """Give up a reservation; idempotent."""
        self.host.abort(lease)

    def write_back(self, lease: Lease) -> None:
        """Queue a chunk already in host memory for write-back; takes over ``lease``.

        ``lease`` is a read lease on the host slot (e.g. from
        :meth:`SlotLoans.adopt` with ``keep_pinned``); the store releases it
        once the chunk is written (or the write is dropped).
        """
        if self._closed:
            self.host.release(lease)
            raise ConfigError(f"tiered store {self.name!r} is closed")
        self._queue_write_back(lease)

    def memory_regions(self) -> list[memoryview]:
        """The host cache's :meth:`HostCache.memory_regions` (every slot view lies inside)."""
        self._check_open()
        return self.host.memory_regions()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back is done; False if ``timeout`` passed first."""
        return self._queue.flush(timeout) if self._queue else True

    def _queue_write_back(self, lease: Lease) -> None:
        if self._queue is None:
            self.host.release(lease)
            return
        if self._queue.offer(lease):
            return
        self.host.release(lease)
        for tier in self._targets:
            tier.count_drop("queue_full")
        self._report_drop(lease.key, "write-behind queue full")

    def _write_back(self, batch: list[Lease]) -> None:
        """Drain-thread side: write a batch to the target tiers, then unpin it.

        The tiers read the slots in place (no copy on the common path). A write
        that times out may still be reading them, so the batch stays pinned
        until every such call has ended: the slots cannot be reused and their
        bytes stored under these keys.
        """

        def release_batch() -> None:
            for lease in batch:
                self.host.release(lease)

        holds = _Holds(release_batch)
        try:
            items = [(lease.key, lease.view) for lease in batch]
            nbytes = sum(len(lease.view) for lease in batch)
            for tier in self._targets:
                self._write_to(tier, items, nbytes, holds=holds)
        finally:
            holds.done()

    def _undo_writes(self, batch: list[Lease]) -> None:
        """Drain-thread side: keys deleted while their write-back was under way."""
        keys = list(dict.fromkeys(lease.key for lease in batch))
        for tier in self._targets:
            try:
                tier.call("delete", tier.store.delete_many, keys)
            except TierUnavailable:
                continue

    def _write_to(
        self,
        tier: GuardedTier,
        items: list[tuple[ChunkKey, Buffer]],
        nbytes: int,
        *,
        if_absent: bool = False,
        holds: _Holds | None = None,
    ) -> bool:
        """Write ``items`` to ``tier``; ``holds`` keeps their memory alive past a timeout.

        Without ``holds`` the buffers must be private to this write (a timed-out
        call may read them later).
        """
        if not tier.writable:  # a full or read-only tier still serves reads
            tier.count_drop("tier_down", len(items))
            for key, _ in items:
                self._report_drop(key, f"tier {tier.name} is down")
            return False
        started = time.perf_counter()
        try:
            write = tier.store.put_if_absent_many if if_absent else tier.store.put_many
            written = tier.call("put", write, items)
        except TierUnavailable as exc:
            if holds is not None:
                holds.until_settled(exc)
            tier.count_drop("tier_error", len(items))
            for key, _ in items:
                self._report_drop(key, f"write to {tier.name} failed")
            return False
        tier.instruments.record_write(nbytes, time.perf_counter() - started)
        with self._lock:
            tier.writes += sum(1 for ok in written if ok)
        return any(written)

    def _write_through(self, key: ChunkKey, data: Buffer, *, if_absent: bool) -> bool:
        """Host memory could not take the chunk: write it to the target tiers now."""
        view: Buffer = memoryview(data).cast("B")
        if any(tier.timeout is not None for tier in self._targets):
            # A call that times out goes on reading its input after we return, while the
            # caller may reuse its buffer: hand the tiers a private copy (slow path only).
            view = bytes(view)
        results = [
            self._write_to(tier, [(key, view)], len(view), if_absent=if_absent)
            for tier in self._targets
        ]
        return any(results)

    def _supersede(self, key: ChunkKey) -> None:
        """Before writing ``key`` around host memory: drop the older copy host memory may
        still hold (its slot pinned for write-back, so it could not be replaced), take back
        its queued write-back and let one under way end first; otherwise reads, and later
        the tiers, would go back to the older bytes."""
        self.host.delete_many([key])
        if self._queue is None:
            return
        known = [t.timeout for t in self._targets if t.timeout is not None]
        bound = max(known) if known and len(known) == len(self._targets) else None
        for lease in self._queue.supersede(lambda lease: lease.key == key, bound):
            self.host.release(lease)

    def _report_drop(self, key: ChunkKey, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._recent_drops.append(key)
            self._drops_unreported += 1
            if now - self._last_drop_log < 10.0:
                return
            count, self._drops_unreported = self._drops_unreported, 0
            self._last_drop_log = now
        log.warning(
            "%s: dropped write-back of %s (%s); %d dropped since the last report",
            self.name,
            key.hex,
            why,
            count,
        )

    # --- reads ----------------------------------------------------------------------------

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        self._check_open()
        started = time.perf_counter()
        out: list[bytes | None] = self.host._read_many(keys)
        if self.verify:
            out = [self._checked(k, d) for k, d in zip(keys, out)]
        hits = sum(1 for d in out if d is not None)
        self._count_host(hits, len(keys) - hits, started, sum(len(d) for d in out if d is not None))
        missing = [i for i, d in enumerate(out) if d is None]
        for tier in self.tiers:
            if not missing:
                break
            wanted = [keys[i] for i in missing]
            started = time.perf_counter()
            try:
                found = tier.call("get", tier.store.get_many, wanted)
            except TierUnavailable:
                self._count_tier(tier, 0, len(wanted))
                continue
            nbytes = sum(len(d) for d in found if d is not None)
            if nbytes:
                tier.instruments.record_read(nbytes, time.perf_counter() - started)
            still_missing = []
            for i, data in zip(missing, found):
                if data is None:
                    still_missing.append(i)
                    continue
                out[i] = data
                self._promote(tier, keys[i], data)
            self._count_tier(tier, len(missing) - len(still_missing), len(still_missing))
            missing = still_missing
        return out

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Stored bytes per key from the first tier holding each, host first.

        For maintenance tools: no verification, no promotion, no hit or
        access-time update in any tier.
        """
        self._check_open()
        out = self.host.read_unchecked_many(keys)
        missing = [i for i, d in enumerate(out) if d is None]
        for tier in self.tiers:
            if not missing:
                break
            try:
                found = tier.call("get", tier.store.read_unchecked_many, [keys[i] for i in missing])
            except TierUnavailable:
                continue
            for i, data in zip(missing, found):
                out[i] = data
            missing = [i for i in missing if out[i] is None]
        return out

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Fill ``buffer`` from the first tier holding ``key``; its size, or ``None``."""
        lease, settled = self._acquire(key)
        if lease is not None:
            try:
                return _copy(buffer, lease.view)
            finally:
                self.host.release(lease)
        if settled:
            return None
        # No promotion (disabled, or host memory full of pinned chunks): read around it.
        return self._load_from_tiers(key, buffer)

    def acquire(self, key: ChunkKey) -> Lease | None:
        """Pin ``key`` in host memory for reading in place, promoting it from a lower tier.

        ``None`` if no tier has it, or if it is not in host memory and cannot be
        promoted (promotion off, or every slot pinned). Release the lease
        (``with lease:``) when done.
        """
        return self._acquire(key)[0]

    def _acquire(self, key: ChunkKey) -> tuple[Lease | None, bool]:
        """(lease, settled): ``settled`` is False when the tiers were not (all) asked."""
        self._check_open()
        started = time.perf_counter()
        lease = self.host.acquire(key)
        if lease is not None and self.verify and self._checked(key, lease.view) is None:
            self.host.release(lease)
            lease = None
        if lease is not None:
            self._count_host(1, 0, started, len(lease.view))
            return lease, True
        self._count_host(0, 1, started, 0)
        if not self.promote:
            return None, False
        for tier in self.tiers:
            if not tier.up:
                self._count_tier(tier, 0, 1)
                continue
            promoted = self._promote_from(tier, key)
            if promoted is _NO_ROOM:
                return None, False
            if isinstance(promoted, Lease):
                return promoted, True
        return None, True

    def _promote_from(self, tier: GuardedTier, key: ChunkKey) -> Lease | object | None:
        """``key`` from ``tier`` into a pinned host slot: a read lease, ``None`` (the tier
        does not have it) or ``_NO_ROOM`` (it may, but every host slot is pinned).

        Host memory is not made room in before the tier has shown it holds the
        chunk: a miss (the common case for a new prompt) must not evict a
        resident chunk, which may exist nowhere else (its write-back dropped).
        A free slot is read into directly; when there is none, a low-latency
        tier is asked ``exists`` first (a stat, then the zero-copy read into
        the evicted slot), a round-trip-bound one is read into a private
        buffer that is then copied in (a copy costs less than a second trip).
        """
        slot = self.host.reserve(key, evict=False)
        if slot is not None:
            return self._promote_into(tier, key, slot)
        if tier.store.high_latency or not isinstance(tier.store, SupportsGetInto):
            return self._promote_copy(tier, key)
        try:
            found = tier.call("exists", tier.store.exists_many, [key])[0]
        except TierUnavailable:
            found = False
        if not found:
            self._count_tier(tier, 0, 1)
            return None
        slot = self.host.reserve(key)
        if slot is None:
            return _NO_ROOM
        return self._promote_into(tier, key, slot)

    def _promote_copy(self, tier: GuardedTier, key: ChunkKey) -> Lease | object | None:
        """Read ``key`` from ``tier`` into private memory, then into host memory (evicting)."""
        started = time.perf_counter()
        try:
            data = tier.call("get", tier.store.get, key)
        except TierUnavailable:
            data = None
        if data is None:
            self._count_tier(tier, 0, 1)
            return None
        outcome = self.host.insert(key, hot_bytes(data), keep_pinned=True)
        if outcome.lease is None:
            return _NO_ROOM  # the caller reads around host memory
        tier.instruments.record_read(len(data), time.perf_counter() - started)
        self._count_tier(tier, 1, 0)
        with self._lock:
            tier.promotions += 1
        tier.instruments.promotions.inc()
        return outcome.lease

    def _promote_into(self, tier: GuardedTier, key: ChunkKey, slot: Lease) -> Lease | None:
        """Load ``key`` from ``tier`` straight into reserved ``slot``; a read lease or ``None``.

        The tier writes into the slot in place (zero-copy, also with a
        timeout). A read that timed out may still write there later, so the
        reservation is then given back only when that call has ended
        (:meth:`TierUnavailable.when_settled`); until then the slot stays
        pinned and cannot be handed to another chunk.

        Why pin rather than read through a private buffer: ``tier_timeout``
        is on by default, so a bounce buffer would cost a copy on every
        promotion (and write-back), while pinning costs only when a call
        actually times out, and then at most one slot per stuck worker (calls
        queued behind it are cancelled and the tier backs off).
        """
        started = time.perf_counter()
        size: int | None = None
        try:
            if isinstance(tier.store, SupportsGetInto):
                size = tier.call("get", tier.store.get_into, key, slot.view)
            else:
                data = tier.call("get", tier.store.get, key)
                if data is not None and len(data) <= len(slot.view):
                    slot.view[: len(data)] = data
                    size = len(data)
            if size:
                size = _decompress_in_place(slot.view, size)
        except TierUnavailable as exc:
            exc.when_settled(lambda: self.host.abort(slot))
            self._count_tier(tier, 0, 1)
            return None
        except BaseException:
            self.host.abort(slot)
            raise
        if not size:
            self.host.abort(slot)
            self._count_tier(tier, 0, 1)
            return None
        tier.instruments.record_read(size, time.perf_counter() - started)
        self.host.commit(slot, size, keep_pinned=True)
        self._count_tier(tier, 1, 0)
        with self._lock:
            tier.promotions += 1
        tier.instruments.promotions.inc()
        return slot

    def _load_from_tiers(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Without promotion: the first tier's copy straight into ``buffer``.

        ``buffer`` is the caller's and is reused as soon as we return, so a
        tier with a timeout (whose call may outlive the wait) reads into
        private memory that is copied over; only an inline call (no timeout)
        gets ``buffer`` itself.
        """
        for tier in self.tiers:
            if not tier.up:
                self._count_tier(tier, 0, 1)
                continue
            started = time.perf_counter()
            try:
                if tier.timeout is None and isinstance(tier.store, SupportsGetInto):
                    size = tier.call("get", tier.store.get_into, key, buffer)
                else:
                    data = tier.call("get", tier.store.get, key)
                    size = None if data is None else _copy(buffer, data)
            except TierUnavailable:
                size = None
            if size is None:
                self._count_tier(tier, 0, 1)
                continue
            tier.instruments.record_read(size, time.perf_counter() - started)
            self._count_tier(tier, 1, 0)
            return size
        return None

    def release(self, lease: Lease) -> None:
        """Unpin a lease from :meth:`acquire`; idempotent."""
        self.host.release(lease)

    def _promote(self, tier: GuardedTier, key: ChunkKey, data: bytes) -> None:
        if not self.promote:
            return
        if self.host.put(key, hot_bytes(data)):
            with self._lock:
                tier.promotions += 1
            tier.instruments.promotions.inc()

    def _count_host(self, hits: int, misses: int, started: float, nbytes: int) -> None:
        instruments = self._host_metrics
        if hits:
            instruments.hits.inc(hits)
            instruments.record_read(nbytes, time.perf_counter() - started)
        if misses:
            instruments.misses.inc(misses)

    def _count_tier(self, tier: GuardedTier, hits: int, misses: int) -> None:
        with self._lock:
            tier.hits += hits
            tier.misses += misses
        if hits:
            tier.instruments.hits.inc(hits)
        if misses:
            tier.instruments.misses.inc(misses)

    # --- presence -------------------------------------------------------------------------

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        started = time.perf_counter()
        present = self.host.exists_many(keys)
        self._host_metrics.lookup_latency.observe(time.perf_counter() - started)
        missing = [i for i, hit in enumerate(present) if not hit]
        for tier in self.tiers:
            if not missing or not tier.up:
                continue
            started = time.perf_counter()
            try:
                found = tier.call("exists", tier.store.exists_many, [keys[i] for i in missing])
            except TierUnavailable:
                continue
            tier.instruments.lookup_latency.observe(time.perf_counter() - started)
            for i, hit in zip(missing, found):
                present[i] = hit
            missing = [i for i in missing if not present[i]]
        return present

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Leading keys present in any tier: host first, then each tier from where it stopped.

        The host is asked again after every tier that made progress: a chunk can be in
        host memory only (its write-back still queued) while older ones were already
        evicted to the tiers, so the prefix may alternate between host and tiers.
        """
        self._check_open()
        position = self._host_prefix(keys, 0)
        progress = True
        while position < len(keys) and progress:
            progress = False
            for tier in self.tiers:
                if position == len(keys) or not tier.up:
                    continue
                found = self._tier_prefix(tier, keys[position:])
                if found:
                    position += found
                    position = self._host_prefix(keys, position)
                    progress = True
        return position

    def _tier_prefix(self, tier: GuardedTier, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` ``tier`` holds; 0 when it fails or times out."""
        started = time.perf_counter()
        try:
            found: int = tier.call("lookup", tier.store.lookup_prefix, keys)
        except TierUnavailable:
            return 0
        tier.instruments.lookup_latency.observe(time.perf_counter() - started)
        return found

    def _host_prefix(self, keys: Sequence[ChunkKey], position: int) -> int:
        """``position`` extended by the keys that follow it in host memory."""
        if position >= len(keys):
            return position
        started = time.perf_counter()
        found = self.host.lookup_prefix(keys[position:])
        self._host_metrics.lookup_latency.observe(time.perf_counter() - started)
        return position + found

    # --- background lookups and prefetch -------------------------------------------------

    def lookup_prefix_async(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """:meth:`lookup_prefix` on a background thread; the future never fails (0 at worst).

        For a scheduler that must not wait for a slow tier: poll ``done()``
        and ask again at its next step.
        """
        keys = list(keys)
        return self._submit(self._lookup_quietly, keys, default=0)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[list[str]]:
        """Bring the leading present ``keys`` into host memory, on a background thread.

        The future resolves to one entry per key from the first on, saying
        where it is now in host memory from: ``"host"`` (was there already) or
        the ``kind`` of the tier it was read from (``"fs"``, ``"s3"``, ``"peer"``,
        ...). It stops at the first key that no tier has or that could not be
        brought in (tier error or timeout, corrupt chunk, host memory full of
        pinned chunks), so ``len(result)`` is the usable prefix. It never
        raises. The prefix is pinned while it is gathered (a later chunk never
        evicts an earlier one) and unpinned when the future resolves: acquire
        the chunks before relying on them.
        """
        keys = list(keys)
        return self._submit(self._prefetch_quietly, keys, default=[])

    def _submit(
        self, fn: Callable[[list[ChunkKey]], R], keys: list[ChunkKey], *, default: R
    ) -> Future[R]:
        with self._lock:
            if not self._closed and self._background is None:
                self._background = ThreadPoolExecutor(
                    max_workers=self._prefetch_workers,
                    thread_name_prefix=f"chunkstore-prefetch-{self.name}",
                )
            background = self._background
        if background is not None:
            try:
                return background.submit(fn, keys)
            except RuntimeError:  # shut down by a concurrent close()
                pass
        done: Future[R] = Future()
        done.set_result(default)
        return done

    def _lookup_quietly(self, keys: list[ChunkKey]) -> int:
        try:
            return self.lookup_prefix(keys)
        except Exception as exc:  # noqa: BLE001 - a background lookup reports a miss instead
            log.warning("%s: background lookup stopped: %s", self.name, exc)
            return 0

    def _prefetch_quietly(self, keys: list[ChunkKey]) -> list[str]:
        sources: list[str] = []
        try:
            self._prefetch_into(keys, sources)
        except Exception as exc:  # noqa: BLE001 - a prefetch ends short instead of failing
            if not self._closed:
                log.warning(
                    "%s: prefetch stopped after %d chunks: %s", self.name, len(sources), exc
                )
        return sources

    def _prefetch_into(self, keys: list[ChunkKey], sources: list[str]) -> None:
        """Walk the chain like :meth:`lookup_prefix`, loading each tier's run into host memory.

        Every chunk of the prefix stays pinned until the walk ends, so loading
        a later chunk can never evict an earlier one: when host memory cannot
        hold more, the prefix ends there.
        """
        held: list[Lease] = []
        try:
            position = 0
            while position < len(keys):
                self._check_open()
                while position < len(keys):
                    lease = self.host.acquire(keys[position])
                    if lease is None:
                        break
                    held.append(lease)
                    sources.append(HOST_SOURCE)
                    position += 1
                if position == len(keys):
                    return
                progress = False
                for tier in self.tiers:
                    if not tier.up:
                        continue
                    found = self._tier_prefix(tier, keys[position:])
                    if not found:
                        continue
                    loaded = self._pull(tier, keys[position : position + found], held)
                    if loaded:
                        sources.extend([tier.store.kind] * loaded)
                        position += loaded
                        progress = True
                        break
                if not progress:
                    return
        finally:
            for lease in held:
                self.host.release(lease)

    def _pull(self, tier: GuardedTier, keys: list[ChunkKey], held: list[Lease]) -> int:
        """Copy ``keys`` from ``tier`` into pinned host slots, in order; how many made it."""
        if tier.store.high_latency or not isinstance(tier.store, SupportsGetInto):
            return self._pull_batched(tier, keys, held)
        if isinstance(tier.store, SupportsGetManyInto):
            return self._pull_into_slots(tier, keys, held)
        loaded = 0
        for key in keys:
            self._check_open()
            slot = self.host.reserve(key)
            if slot is None:
                return loaded
            lease = self._promote_into(tier, key, slot)
            if lease is None:
                return loaded
            held.append(lease)
            loaded += 1
        return loaded

    def _pull_into_slots(
        self, tier: GuardedTier, keys: list[ChunkKey], held: list[Lease], batch: int = 16
    ) -> int:
        """Tiers with batched zero-copy reads: reserve host slots for up to ``batch`` chunks,
        then let the tier fill them all with several reads in flight (``get_many_into``).

        The prefix ends at the first chunk that did not arrive; its slot and the later
        ones of the batch are given back. A call that timed out keeps the whole batch
        reserved until it has ended (it may still write into the slots), as
        :meth:`_promote_into` does for one slot.
        """
        store: Any = tier.store
        loaded = 0
        for start in range(0, len(keys), batch):
            self._check_open()
            slots: list[Lease] = []
            for key in keys[start : start + batch]:
                slot = self.host.reserve(key)
                if slot is None:
                    break
                slots.append(slot)
            if not slots:
                return loaded
            started = time.perf_counter()
            try:
                sizes = tier.call(
                    "get", store.get_many_into, [s.key for s in slots], [s.view for s in slots]
                )
            except TierUnavailable as exc:
                exc.when_settled(lambda slots=slots: self._abort_all(slots))
                self._count_tier(tier, 0, len(slots))
                return loaded
            except BaseException:
                self._abort_all(slots)
                raise
            arrived = 0
            nbytes = 0
            for slot, size in zip(slots, sizes):
                size = _decompress_in_place(slot.view, size) if size else 0
                if not size:
                    break
                self.host.commit(slot, size, keep_pinned=True)
                held.append(slot)
                arrived += 1
                nbytes += size
            self._abort_all(slots[arrived:])
            if nbytes:
                tier.instruments.record_read(nbytes, time.perf_counter() - started)
            self._count_tier(tier, arrived, 1 if arrived < len(slots) else 0)
            with self._lock:
                tier.promotions += arrived
            tier.instruments.promotions.inc(arrived)
            loaded += arrived
            if arrived < min(batch, len(keys) - start):
                return loaded
        return loaded

    def _abort_all(self, slots: list[Lease]) -> None:
        for slot in slots:
            self.host.abort(slot)

    def _pull_batched(
        self, tier: GuardedTier, keys: list[ChunkKey], held: list[Lease], batch: int = 16
    ) -> int:
        """Round-trip-bound tiers: ask for ``batch`` chunks per call (the store overlaps them)."""
        loaded = 0
        for start in range(0, len(keys), batch):
            self._check_open()
            wanted = keys[start : start + batch]
            started = time.perf_counter()
            try:
                found: list[Any] = tier.call("get", tier.store.get_many, wanted)
            except TierUnavailable:
                self._count_tier(tier, 0, 1)
                return loaded
            nbytes = sum(len(d) for d in found if d is not None)
            if nbytes:
                tier.instruments.record_read(nbytes, time.perf_counter() - started)
            for key, data in zip(wanted, found):
                outcome = (
                    None
                    if data is None
                    else self.host.insert(key, hot_bytes(data), keep_pinned=True)
                )
                if outcome is None or outcome.lease is None:
                    self._count_tier(tier, 0, 1)
                    return loaded
                held.append(outcome.lease)
                self._count_tier(tier, 1, 0)
                with self._lock:
                    tier.promotions += 1
                tier.instruments.promotions.inc()
                loaded += 1
        return loaded

    # --- admin ----------------------------------------------------------------------------

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        self._check_open()
        if self._queue is not None:
            # A queued write-back would resurrect the chunk after we delete it. Withdraw those
            # instead of waiting for the queue (a stalled tier would stall the caller, and the
            # quarantine of a corrupt host chunk runs on the read path); one being written
            # now is undone by the drain thread when it ends (_undo_writes).
            wanted = set(keys)
            for lease in self._queue.withdraw(lambda lease: lease.key in wanted):
                self.host.release(lease)
        present = self.exists_many(keys)
        self.host.delete_many(keys)
        for tier in self.tiers:
            try:
                tier.call("delete", tier.store.delete_many, keys)
            except TierUnavailable:
                continue
        return sum(present)

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        seen: set[ChunkKey] = set()
        for info in self.host.list(namespace):
            seen.add(info.key)
            yield info
        for tier in self.tiers:
            if not tier.store.supports_listing:
                continue
            try:
                listed = tier.call("list", lambda s=tier.store: list(s.list(namespace)))
            except TierUnavailable:
                continue
            for info in listed:
                if info.key not in seen:
                    seen.add(info.key)
                    yield info

    @property
    def supports_listing(self) -> bool:
        """Listing covers host memory and every tier that can list."""
        return all(t.store.supports_listing for t in self.tiers)

    @property
    def high_latency(self) -> bool:
        """Never: the host index answers first and each tier picks its own strategy."""
        return False

    def close(self) -> None:
        """Flush pending write-backs, stop the drain thread, close host memory (and tiers)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            background, self._background = self._background, None
        if background is not None:
            # Jobs see the store closed at their next step and resolve with what they have.
            background.shutdown(wait=True)
        if self._queue is not None:
            for lease in self._queue.close():
                self.host.release(lease)
        for tier in self.tiers:
            tier.close()
            if self.close_tiers:
                try:
                    tier.store.close()
                except Exception:  # noqa: BLE001 - closing must not stop closing the rest
                    log.exception("closing tier %s failed", tier.name)
        self.host.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"tiered store {self.name!r} is closed")

    def __repr__(self) -> str:
        names = ", ".join([self.host.name, *(t.name for t in self.tiers)])
        return f"TieredStore({names}; write_tiers={self.write_tiers!r})"


_NO_ROOM = object()
"""Promotion outcome: the tier may have the chunk, but every host slot is pinned."""


class _Holds:
    """Releases a write-back batch once the drain thread and every abandoned write are done."""

    __slots__ = ("_count", "_lock", "_release")

    def __init__(self, release: Callable[[], None]) -> None:
        self._count = 1
        self._lock = threading.Lock()
        self._release = release

    def until_settled(self, failure: TierUnavailable) -> None:
        """Keep the batch until the call behind ``failure`` has ended (if it still runs)."""
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


def hot_bytes(data: Any) -> Any:
    """``data`` as host memory should hold it: uncompressed, ready to copy to a device.

    Cold tiers may keep chunks zstd-compressed (spec/FORMAT.md §4.4); promotion
    decompresses them so every host slot can be read through the layout's views.
    Bytes that do not parse are returned as they are: the tier that served them
    already verified them, and the host cache never interprets them otherwise.
    """
    try:
        if read_header(data).compression == "none":
            return data
        return recompress(data, "none")
    except FormatError:
        return data


def _decompress_in_place(view: memoryview, size: int) -> int:
    """Decompress a chunk read into ``view[:size]`` in place if it is compressed; its new size."""
    stored = view[:size]
    plain = hot_bytes(stored)
    if plain is stored:
        return size
    if len(plain) > len(view):
        return 0  # cannot hold it uncompressed: not promoted
    view[: len(plain)] = plain
    return len(plain)


def _copy(buffer: Buffer, data: bytes | memoryview) -> int:
    target = memoryview(buffer).cast("B")
    if len(target) < len(data):
        raise ConfigError(
            f"buffer of {len(target)} bytes is too small for a {len(data)}-byte chunk"
        )
    target[: len(data)] = data
    return len(data)
