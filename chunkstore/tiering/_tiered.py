"""TieredStore: the host cache in front of secondary tiers, as one store.

* ``put``: the chunk goes into host memory first. The caller's copy is then
  done. The chunk stays pinned in its host slot and is queued. A background
  thread writes it to the secondary tiers. ``write_tiers="all"`` writes every
  tier; ``"first"`` writes the first only. A full queue drops the write. It
  never blocks the caller or grows memory. Each drop is counted per tier as
  ``queue_full`` and logged with the key. Host memory may refuse the chunk.
  Every slot may be pinned, or the chunk may exceed a slot. The chunk is then
  written to the tiers synchronously.
* ``get``, ``get_into`` and ``acquire`` read from the first tier that has the
  chunk, host first. A hit in a lower tier is copied into host memory. This
  is promotion.
* ``lookup_prefix`` asks the host index first. It then asks each tier, in
  batches, from where the previous one stopped. It repeats until a full pass
  over the tiers adds nothing.
* ``prefetch`` and ``lookup_prefix_async`` run the same walk on a background
  thread. They return a future that never fails. A tier error only shortens
  the result. ``prefetch`` also copies the chunks it finds into host memory.
  It reports where each came from.
* A tier that raises or times out gives a miss on reads or a dropped write.
  It is retried after ``retry_after`` seconds. The caller never sees its
  exception. A timed-out call keeps running in the background. Host memory
  handed to it stays pinned until it ends. That memory is a slot being
  promoted into or written back. A caller's own buffer never goes to a call
  that may outlive it. A private copy goes instead.
* ``delete`` never waits for the write-behind queue. It withdraws queued
  write-backs of the deleted keys. A write already under way is undone when it
  ends. The keys are then deleted again from the tiers.
* Eviction never loses a chunk that waits for write-back. Its slot is pinned
  until written. :meth:`TieredStore.close` flushes the queue. A crash loses at
  most the queued chunks, and only their host copies.

``TieredStore`` is the public face. Its parts each live in their own module:

* :mod:`~chunkstore.tiering._guard`: a tier's timeout, back-off and counters.
* :mod:`~chunkstore.tiering._promotion`: copying chunks up into host memory.
* :mod:`~chunkstore.tiering._prefetch`: the background walks.
* :mod:`~chunkstore.tiering._writes`: write-behind and write-through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from chunkstore.backends.base import Buffer, ChunkInfo, Store
from chunkstore.cache._host import HostCache, HostCacheStats
from chunkstore.cache._lease import Lease
from chunkstore.errors import ConfigError
from chunkstore.events import ChunkListener
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics, default_metrics
from chunkstore.tiering._guard import GuardedTier, TierUnavailable
from chunkstore.tiering._prefetch import Prefetcher
from chunkstore.tiering._promotion import NO_ROOM, Promoter
from chunkstore.tiering._tierlist import TierList, keep_all
from chunkstore.tiering._writes import TierWriter

log = logging.getLogger(__name__)

WRITE_TIERS = ("all", "first")
"""The ``write_tiers`` values: write to every secondary tier, or to the first only."""


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one secondary tier."""

    name: str
    """The tier's store name, which is its metric label."""
    hits: int
    """Chunks this tier served after every tier above it missed."""
    misses: int
    """Chunks asked of this tier that it did not have or could not serve."""
    promotions: int
    """Chunks copied from this tier into host memory."""
    writes: int
    """Chunks written into this tier."""
    dropped: dict[str, int]
    """Writes to this tier not performed, by reason: queue_full, tier_down or tier_error."""
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
    """Per secondary tier, its name and whether it answers."""


class TieredStore(Store):
    """A :class:`HostCache` in front of secondary stores; the module docstring has the rules.

    The tiered store owns ``host``. With ``close_tiers`` it owns the tiers too.
    It closes what it owns in :meth:`close`. ``tier_timeout=None`` calls tiers
    inline, with no timeout thread. Tests of the back-off pass ``clock``.
    ``prefetch_workers`` threads serve :meth:`prefetch` and
    :meth:`lookup_prefix_async`.

    ``verify`` checks chunks served from host memory. A corrupt one is counted
    and deleted from every tier. On every read path, ``verify`` also checks
    chunks from a tier opened without ``verify``. A corrupt one is counted. That
    tier sets it aside, without waiting. A lower tier's copy is read next.
    ``verify`` is off by default. Host memory is trusted, and every secondary
    tier checks what it returns.

    The class is the layer's whole ``Store`` interface. Each method routes. The
    work is in the modules named above.
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
        self._tier_list = TierList(self.tiers)
        self._closed = False
        self._writer = TierWriter(
            host,
            self.tiers[:1] if write_tiers == "first" else self.tiers,
            queue_size=queue_size,
            write_batch=write_batch,
            name=self.name,
        )
        self._promoter = Promoter(
            host, self._check_open, self._check_tier_bytes, self._writer.deleted_in_flight
        )
        self._prefetcher = Prefetcher(
            host,
            self.tiers,
            self._promoter,
            self.lookup_prefix,
            check_open=self._check_open,
            closed=lambda: self._closed,
            name=self.name,
            workers=prefetch_workers,
        )
        self.metrics.watch_host(host)
        self.metrics.watch_store(host)
        for tier in tiers:
            self.metrics.watch_store(tier)
        self.metrics.watch_tiered(self)

    def watch(self, listener: ChunkListener | None) -> None:
        """Tell ``listener`` what host memory publishes and drops.

        It also hears what write-back and write-through store in the tiers.
        There is one listener at a time. None stops the calls.
        """
        self.host.listener = listener
        self._writer.listener = listener

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
            queue_depth=self._writer.pending,
            writes_dropped=sum(sum(t.dropped.values()) for t in tiers),
        )

    def health(self) -> TieredHealth:
        """Queue depth and tier liveness, for the metrics collector."""
        return TieredHealth(
            queue_depth=self._writer.depth,
            queue_capacity=self._writer.capacity,
            tiers_up=tuple((t.name, t.up) for t in self.tiers),
        )

    def dropped_keys(self) -> list[ChunkKey]:
        """The latest chunks whose write-back was dropped, up to 100, oldest first."""
        return self._writer.dropped_keys()

    @property
    def corrupt_detected(self) -> int:
        """Corrupt chunks found in host memory with ``verify``, and by every tier."""
        return (
            self._corrupt
            + self.host.corrupt_detected
            + sum(t.store.corrupt_detected for t in self.tiers)
        )

    def _quarantine(self, key: ChunkKey, reason: str) -> str:
        # A chunk found corrupt in host memory went to the tiers from the same bytes.
        return "deleted from host memory and every tier" if self.delete_many([key]) else "gone"

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
                self._writer.supersede(key)
            return self._writer.write_through(key, data, if_absent=if_absent)
        self._host_metrics.record_write(len(outcome.lease.view), time.perf_counter() - started)
        self._writer.enqueue(outcome.lease)
        return True

    def reserve(self, key: ChunkKey) -> Lease | None:
        """A pinned writable host slot for ``key``, as :meth:`HostCache.reserve` gives.

        ``None`` means every slot is pinned. Fall back to :meth:`put` with a
        buffer of your own. Finish with :meth:`commit` or :meth:`abort`.
        """
        self._check_open()
        return self.host.reserve(key)

    def commit(self, lease: Lease, length: int | None = None) -> None:
        """Publish a reserved slot in host memory and queue its write-back."""
        self._check_open()
        self.host.commit(lease, length, keep_pinned=True)
        self._writer.enqueue(lease)

    def abort(self, lease: Lease) -> None:
        """Give up a reservation; a second call does nothing."""
        self.host.abort(lease)

    def write_back(self, lease: Lease) -> None:
        """Queue a chunk already in host memory for write-back; take over ``lease``.

        ``lease`` is a read lease on the host slot. :meth:`SlotLoans.adopt`
        with ``keep_pinned`` gives one. The store releases it once the chunk is
        written or the write is dropped.
        """
        if self._closed:
            self.host.release(lease)
            raise ConfigError(f"tiered store {self.name!r} is closed")
        self._writer.enqueue(lease)

    def memory_regions(self) -> list[memoryview]:
        """The host cache's :meth:`HostCache.memory_regions`; every slot view lies inside."""
        self._check_open()
        return self.host.memory_regions()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write-back is done; False if ``timeout`` passed first."""
        return self._writer.flush(timeout)

    # --- reads ----------------------------------------------------------------------------

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Chunk bytes per key, from host memory first, then each tier.

        An entry is ``None`` where no tier has a good copy. Each chunk is
        checked once. With ``verify``, this store checks chunks from host
        memory and from tiers that do not check their own. The other tiers
        check theirs.
        """
        return self._read_many(keys)

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        self._check_open()
        started = time.perf_counter()
        out: list[bytes | None] = self.host._read_many(keys)
        if self.verify:
            out = [self._checked(k, d) for k, d in zip(keys, out)]
        hits = sum(1 for d in out if d is not None)
        self._count_host(hits, len(keys) - hits, started, sum(len(d) for d in out if d is not None))
        missing = [i for i, d in enumerate(out) if d is None]
        if missing:
            found = self._tier_list.read_many(
                [keys[i] for i in missing], judge=self._judge_tier_bytes, count=True
            )
            for i, data in zip(missing, found):
                out[i] = data
        return out

    def _judge_tier_bytes(
        self, tier: GuardedTier, key: ChunkKey, data: Any, tier_verifies: bool
    ) -> Any | None:
        """``data`` if it may be served, else None; promote it into host memory if asked."""
        checked = self._check_tier_bytes(tier, key, data, tier_verifies)
        if checked is False:
            return None
        if self.promote:
            self._promoter.promote_bytes(tier, key, data, verified=bool(checked))
        return data

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Stored bytes per key from the first tier that holds each, host first.

        This is for maintenance tools. It verifies nothing and promotes
        nothing. No tier updates hits or access times.
        """
        self._check_open()
        out = self.host.read_unchecked_many(keys)
        missing = [i for i, d in enumerate(out) if d is None]
        if missing:
            found = self._tier_list.read_many(
                [keys[i] for i in missing], judge=keep_all, unchecked=True
            )
            for i, data in zip(missing, found):
                out[i] = data
        return out

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Fill ``buffer`` from the first tier holding ``key``; return the size, or ``None``."""
        lease, settled = self._acquire(key)
        if lease is not None:
            try:
                return _copy(buffer, lease.view)
            finally:
                self.host.release(lease)
        if settled:
            return None
        # No promotion, because it is off or every host slot is pinned: read around it.
        return self._load_from_tiers(key, buffer)

    def acquire(self, key: ChunkKey) -> Lease | None:
        """Pin ``key`` in host memory for reading in place, promoting it from a lower tier.

        Returns ``None`` if no tier has it. Also returns ``None`` if it is not
        in host memory and cannot be promoted. Promotion may be off, or every
        slot pinned. Release the lease when done, as with ``with lease:``.
        """
        return self._acquire(key)[0]

    def _acquire(self, key: ChunkKey) -> tuple[Lease | None, bool]:
        """A lease and ``settled``, which is False when not every tier was asked."""
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
                tier.count_reads(0, 1)
                continue
            promoted = self._promoter.promote_from(tier, key)
            if promoted is NO_ROOM:
                return None, False
            if isinstance(promoted, Lease):
                return promoted, True
        return None, True

    def _check_tier_bytes(
        self, tier: GuardedTier, key: ChunkKey, data: Any, tier_verifies: bool
    ) -> bool | None:
        """Whether ``data``, served by ``tier`` as ``key``'s chunk, was checked and may be served.

        True means the tier's read checked it. ``tier_verifies`` is the tier's
        ``verify`` as it stood when the read began. A flag read later might
        have turned on meanwhile. It would vouch for bytes nobody checked. With
        ``verify``, True also means the chunk passed the check here. A corrupt
        chunk is counted and set aside, and the answer is False. ``None`` means
        nothing checked it: ``verify`` is off here and in the tier.

        The chunk is judged as the tier's own verifying read would judge it.
        That uses the tier's MAC key and model, where it knows them. Damage is
        counted. The tier's guarded quarantine sets its copy aside. Unlike a
        corrupt host chunk, it is not deleted from every tier. A lower tier's
        copy is intact and is served next.

        The set-aside is I/O on the tier and may stall. It may be a rename on a
        mount, or requests to S3 or a peer. It goes to the tier's guard, and
        nobody waits for it. So the read moves on at once, to its miss or the
        next tier's copy. A tier in back-off for writes is not asked. The copy
        then stays and is logged. A later read finds it again.
        """
        if tier_verifies:
            return True
        if not self.verify:
            return None
        judgement = tier.store._judge(key, data)
        with tier.handing_off_set_asides():
            return tier.store._admit(key, judgement)

    def _load_from_tiers(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Read the first tier's good copy into ``buffer``, without promotion.

        ``buffer`` is the caller's. The caller reuses it as soon as this
        returns. A tier with a timeout has calls that may outlive the wait. Such
        tiers read into their own memory, which is then copied over. Tiers with
        no timeout read into ``buffer`` itself.
        """
        inline = all(tier.timeout is None for tier in self._tier_list)
        (data,) = self._tier_list.read_many(
            [key], judge=self._judge_unpromoted, buffers=[buffer] if inline else None, count=True
        )
        if data is None:
            return None
        if isinstance(data, memoryview) and data.obj is memoryview(buffer).obj:
            return len(data)  # read in place
        return _copy(buffer, data)

    def _judge_unpromoted(
        self, tier: GuardedTier, key: ChunkKey, data: Any, tier_verifies: bool
    ) -> Any | None:
        """``data`` if it may be served, else None; the tier counts and sets aside a bad copy."""
        return None if self._check_tier_bytes(tier, key, data, tier_verifies) is False else data

    def release(self, lease: Lease) -> None:
        """Unpin a lease from :meth:`acquire`; a second call does nothing."""
        self.host.release(lease)

    def _count_host(self, hits: int, misses: int, started: float, nbytes: int) -> None:
        instruments = self._host_metrics
        if hits:
            instruments.hits.inc(hits)
            instruments.record_read(nbytes, time.perf_counter() - started)
        if misses:
            instruments.misses.inc(misses)

    # --- presence -------------------------------------------------------------------------

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        started = time.perf_counter()
        present = self.host.exists_many(keys)
        self._host_metrics.lookup_latency.observe(time.perf_counter() - started)
        missing = [i for i, hit in enumerate(present) if not hit]
        if missing:
            found = self._tier_list.exists_many([keys[i] for i in missing])
            for i, hit in zip(missing, found):
                present[i] = hit
        return present

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys any tier holds: host first, then each tier in turn.

        Each tier starts where the previous one stopped. The host is asked again
        after every tier that made progress. A chunk can be in host memory only,
        with its write-back still queued. Older chunks may already be evicted to
        the tiers. So the prefix may alternate between host and tiers.
        """
        self._check_open()
        position = self._host_prefix(keys, 0)
        progress = True
        while position < len(keys) and progress:
            progress = False
            for tier in self.tiers:
                if position == len(keys) or not tier.up:
                    continue
                found = tier.lookup_prefix(keys[position:])
                if found:
                    position += found
                    position = self._host_prefix(keys, position)
                    progress = True
        return position

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
        """Run :meth:`lookup_prefix` on a background thread; the future never fails.

        The result is 0 at worst. This serves a scheduler that must not wait for
        a slow tier. It polls ``done()`` and asks again at its next step.
        """
        return self._prefetcher.lookup_prefix_async(keys)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[list[str]]:
        """Bring the leading present ``keys`` into host memory, on a background thread.

        The future resolves to one entry per key, from the first on. Each entry
        says where the chunk now in host memory came from. ``"host"`` means it
        was there already. Otherwise it is the ``kind`` of the tier it was read
        from, such as ``"fs"``, ``"s3"`` or ``"peer"``.

        It stops at the first key that no tier has or that it cannot bring in.
        A tier error or timeout, a corrupt chunk, or host memory full of pinned
        chunks can cause that. So ``len(result)`` is the usable prefix. It never
        raises. The prefix stays pinned while it is gathered. A later chunk thus
        never evicts an earlier one. It is unpinned when the future resolves.
        Acquire the chunks before relying on them.
        """
        return self._prefetcher.prefetch(keys)

    # --- admin ----------------------------------------------------------------------------

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        self._check_open()
        # A queued write-back would resurrect the chunk after we delete it. Withdraw those;
        # do not wait for the queue. A stalled tier would stall the caller, and the quarantine
        # of a corrupt host chunk runs on the read path. The drain thread undoes a write in
        # progress when it ends.
        self._writer.withdraw(keys)
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
        """False: the host index answers first, and each tier picks its own strategy."""
        return False

    def close(self) -> None:
        """Flush pending write-backs, stop the drain thread and close host memory.

        Close the tiers too where this store owns them.
        """
        if self._closed:
            return
        self._closed = True
        # Background jobs see the store closed at their next step and resolve with what they have.
        self._prefetcher.close()
        self._writer.close()
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


def _copy(buffer: Buffer, data: bytes | memoryview) -> int:
    target = memoryview(buffer).cast("B")
    if len(target) < len(data):
        raise ConfigError(
            f"buffer of {len(target)} bytes is too small for a {len(data)}-byte chunk"
        )
    target[: len(data)] = data
    return len(data)
