"""The promoter, which copies chunks from a secondary tier into host memory.

A read that missed host memory promotes one chunk at a time. It uses
:meth:`Promoter.promote_from` or :meth:`Promoter.promote_bytes`. A prefetch
promotes a run of a chain with :meth:`Promoter.pull`. Every chunk lands
decompressed in a host slot that stays pinned for the caller; see
:func:`~chunkstore.format.hot_bytes`. A chunk that carries a MAC lands as it
came. Decompressing would drop the MAC.

A tier call that timed out may still write into its slot. Such a slot goes
back only when the call has ended, through
:meth:`~chunkstore.tiering._guard.TierUnavailable.when_settled`. Until then
it stays pinned. No other chunk gets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from chunkstore.backends.base import SupportsGetInto, SupportsGetManyInto
from chunkstore.cache._host import HostCache
from chunkstore.cache._lease import Lease
from chunkstore.format._hot import decompress_in_place, hot_bytes
from chunkstore.hashing import ChunkKey
from chunkstore.tiering._guard import GuardedTier, TierUnavailable

NO_ROOM = object()
"""Promotion outcome: the tier may have the chunk, but every host slot is pinned."""

PULL_BATCH = 16
"""Chunks a prefetch asks of a tier per call; batched tiers overlap them."""


class Promoter:
    """Copies chunks from :class:`GuardedTier` tiers into pinned slots of ``host``.

    ``check_open`` raises when the owning store has closed. A long pull calls it
    between chunks. So closing the store ends the pull early.

    ``check`` judges the bytes a tier served before they land in host memory.
    It gets the tier's ``verify`` as it stood when the read began. It returns
    True when the tier's read or ``check`` itself checked the bytes. It returns
    False when the bytes may not be served. ``check`` then counts them and sets
    them aside. The promotion ends as a miss. It returns ``None`` when nothing
    checked the bytes. Decompressing then hashes a compressed chunk.
    """

    def __init__(
        self,
        host: HostCache,
        check_open: Callable[[], None],
        check: Callable[[GuardedTier, ChunkKey, Any, bool], bool | None],
        withheld: Callable[[ChunkKey], bool] = lambda key: False,
    ) -> None:
        self.host = host
        """Where promoted chunks go."""
        self._check_open = check_open
        self._check = check
        # A chunk deleted while its write-back was landing. The tiers' copy is about to be
        # undone; promoted, it would outlive the undo in host memory.
        self._withheld = withheld

    # --- one chunk, for a read ---------------------------------------------------------------

    def promote_from(self, tier: GuardedTier, key: ChunkKey) -> Lease | object | None:
        """Copy ``key`` from ``tier`` into a pinned host slot.

        Returns a read lease, or ``None`` when the tier lacks the chunk. Returns
        :data:`NO_ROOM` when the tier may have it but every host slot is pinned.

        Nothing is evicted before the tier shows that it holds the chunk. A miss
        is the common case for a new prompt. It must not evict a resident
        chunk. That chunk may exist nowhere else if its write-back was dropped.

        A free slot is read into directly. Without one, a low-latency tier is
        first asked ``exists``, a stat. The zero-copy read into the evicted slot
        follows. A round-trip-bound tier is read into a private buffer. That
        buffer is then copied in. A copy costs less than a second trip.
        """
        if self._withheld(key):
            return None
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
            tier.count_reads(0, 1)
            return None
        slot = self.host.reserve(key)
        if slot is None:
            return NO_ROOM
        return self._promote_into(tier, key, slot)

    def promote_bytes(
        self, tier: GuardedTier, key: ChunkKey, data: bytes, *, verified: bool
    ) -> None:
        """Copy ``data``, just read from ``tier``, into host memory if it fits.

        The copy is not pinned. ``verified`` says that the tier's read or the
        caller checked its checksum.
        """
        if self._withheld(key):
            return
        if self.host.put(key, hot_bytes(data, verified=verified)):
            tier.count_promotions()

    def _promote_copy(self, tier: GuardedTier, key: ChunkKey) -> Lease | object | None:
        """Read ``key`` from ``tier`` into private memory, then into host memory.

        This may evict.
        """
        started = time.perf_counter()
        tier_verifies = tier.store.verify
        try:
            data = tier.call("get", tier.store.get, key)
        except TierUnavailable:
            data = None
        checked = None if data is None else self._check(tier, key, data, tier_verifies)
        if data is None or checked is False:
            tier.count_reads(0, 1)
            return None
        outcome = self.host.insert(key, hot_bytes(data, verified=bool(checked)), keep_pinned=True)
        if outcome.lease is None:
            return NO_ROOM  # the caller reads around host memory
        tier.instruments.record_read(len(data), time.perf_counter() - started)
        tier.count_reads(1, 0)
        tier.count_promotions()
        return outcome.lease

    def _promote_into(self, tier: GuardedTier, key: ChunkKey, slot: Lease) -> Lease | None:
        """Load ``key`` from ``tier`` straight into reserved ``slot``.

        Returns a read lease, or ``None``. The tier writes into the slot in
        place. This is zero-copy, even with a timeout. A read that timed out
        keeps the reservation until it ends.
        """
        # Why pin rather than read through a private buffer? tier_timeout is on by default,
        # so a bounce buffer would cost a copy on every promotion and write-back. Pinning
        # costs only when a call times out, and then at most one slot per stuck worker.
        # Calls queued behind it are cancelled and the tier backs off.
        started = time.perf_counter()
        size: int | None = None
        tier_verifies = tier.store.verify
        try:
            if isinstance(tier.store, SupportsGetInto):
                size = tier.call("get", tier.store.get_into, key, slot.view)
            else:
                data = tier.call("get", tier.store.get, key)
                if data is not None and len(data) <= len(slot.view):
                    slot.view[: len(data)] = data
                    size = len(data)
            checked = None
            if size:
                checked = self._check(tier, key, slot.view[:size], tier_verifies)
                size = 0 if checked is False else size
            if size:
                size = decompress_in_place(slot.view, size, verified=bool(checked))
        except TierUnavailable as exc:
            exc.when_settled(lambda: self.host.abort(slot))
            tier.count_reads(0, 1)
            return None
        except BaseException:
            self.host.abort(slot)
            raise
        if not size:
            self.host.abort(slot)
            tier.count_reads(0, 1)
            return None
        tier.instruments.record_read(size, time.perf_counter() - started)
        self.host.commit(slot, size, keep_pinned=True)
        tier.count_reads(1, 0)
        tier.count_promotions()
        return slot

    # --- a run of chunks, for a prefetch -------------------------------------------------------

    def pull(self, tier: GuardedTier, keys: list[ChunkKey], held: list[Lease]) -> int:
        """Copy ``keys`` from ``tier`` into pinned host slots, in order; return how many made it.

        The read leases of the chunks that made it are appended to ``held``.
        The caller releases them.
        """
        if any(self._withheld(key) for key in keys):
            keys = keys[: next(i for i, key in enumerate(keys) if self._withheld(key))]
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
        self, tier: GuardedTier, keys: list[ChunkKey], held: list[Lease], batch: int = PULL_BATCH
    ) -> int:
        """Pull for tiers with batched zero-copy reads.

        Reserve host slots for up to ``batch`` chunks. The tier then fills them
        with several reads in flight, through ``get_many_into``. The prefix ends
        at the first chunk that did not arrive. Its slot and the batch's later
        slots are given back. A call that timed out may still write into the
        slots. So it keeps the whole batch reserved until it has ended.
        :meth:`_promote_into` does the same for one slot.
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
            tier_verifies = store.verify
            try:
                sizes = tier.call(
                    "get", store.get_many_into, [s.key for s in slots], [s.view for s in slots]
                )
            except TierUnavailable as exc:
                exc.when_settled(partial(self._abort_all, slots))
                tier.count_reads(0, len(slots))
                return loaded
            except BaseException:
                self._abort_all(slots)
                raise
            arrived = 0
            nbytes = 0
            for slot, size in zip(slots, sizes):
                checked = (
                    self._check(tier, slot.key, slot.view[:size], tier_verifies) if size else False
                )
                if checked is False:
                    break
                size = decompress_in_place(slot.view, size, verified=bool(checked))
                if not size:
                    break
                self.host.commit(slot, size, keep_pinned=True)
                held.append(slot)
                arrived += 1
                nbytes += size
            self._abort_all(slots[arrived:])
            if nbytes:
                tier.instruments.record_read(nbytes, time.perf_counter() - started)
            tier.count_reads(arrived, 1 if arrived < len(slots) else 0)
            tier.count_promotions(arrived)
            loaded += arrived
            if arrived < min(batch, len(keys) - start):
                return loaded
        return loaded

    def _pull_batched(
        self, tier: GuardedTier, keys: list[ChunkKey], held: list[Lease], batch: int = PULL_BATCH
    ) -> int:
        """Pull for round-trip-bound tiers: ask for ``batch`` chunks per call.

        The store overlaps them.
        """
        loaded = 0
        for start in range(0, len(keys), batch):
            self._check_open()
            wanted = keys[start : start + batch]
            started = time.perf_counter()
            tier_verifies = tier.store.verify
            try:
                found: list[Any] = tier.call("get", tier.store.get_many, wanted)
            except TierUnavailable:
                tier.count_reads(0, 1)
                return loaded
            nbytes = sum(len(d) for d in found if d is not None)
            if nbytes:
                tier.instruments.record_read(nbytes, time.perf_counter() - started)
            for key, data in zip(wanted, found):
                checked = None if data is None else self._check(tier, key, data, tier_verifies)
                outcome = (
                    None
                    if data is None or checked is False
                    else self.host.insert(
                        key,
                        hot_bytes(data, verified=bool(checked)),
                        keep_pinned=True,
                    )
                )
                if outcome is None or outcome.lease is None:
                    tier.count_reads(0, 1)
                    return loaded
                held.append(outcome.lease)
                tier.count_reads(1, 0)
                tier.count_promotions()
                loaded += 1
        return loaded

    def _abort_all(self, slots: list[Lease]) -> None:
        for slot in slots:
            self.host.abort(slot)
