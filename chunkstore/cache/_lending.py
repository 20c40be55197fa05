"""Slots a host cache lends to TP rank processes: the owner side of TP shard assembly.

A :class:`~chunkstore.cache._host.HostCache` stores chunks.
Its :class:`SlotLoans`, ``cache.loans``, keeps a few of its slots out of the cache.
They are in state ``LENT``, so rank processes can claim them without a round trip.
See :mod:`chunkstore.cache.assembly`.
A lent slot comes back in one of three ways.
By adoption: the ranks sealed a chunk in it, and it is published as a cached chunk.
By being taken back: its claim was aborted, and it is lent again.
By a recall: nobody claimed it, and it is free again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chunkstore.cache._pool import ABORTED, LENT, SEALED, StaleSlot

if TYPE_CHECKING:
    from chunkstore.cache._host import Adoption, HostCache


class SlotLoans:
    """The slots ``cache`` has on loan to rank processes, in any assembly state.
    Thread-safe: every method runs under the cache's lock, which is its pool's."""

    def __init__(self, cache: HostCache) -> None:
        self._cache = cache
        self._slots: set[int] = set()

    def __len__(self) -> int:
        return len(self._slots)

    def lend(self, available: int) -> int:
        """Keep ``available`` unclaimed slots on loan. Returns how many are unclaimed now.

        It lends free slots first, and evicts by policy when there are none.
        It never evicts a pinned or unpersisted chunk.
        :class:`~chunkstore.cache.assembly._owner.AssemblyOwner` uses it.
        """
        cache = self._cache
        pool = cache.pool
        with pool:
            cache._check_open()
            cache._reclaim_doomed()
            ready = sum(1 for s in self._slots if pool.state(s) == LENT)
            while ready < available:
                slot = cache._spare_slot()
                if slot is None:
                    break
                pool.lend(slot)
                self._slots.add(slot)
                ready += 1
            return ready

    def lent(self) -> tuple[int, ...]:
        """Slot numbers on loan (any assembly state), ascending."""
        with self._cache.pool:
            return tuple(sorted(self._slots))

    def adopt(self, slot: int, *, keep_pinned: bool = False) -> Adoption:
        """Take a SEALED lent slot into the cache as a READY chunk.

        The chunk becomes visible to every reader and enters the policy.
        The lent room was already counted, so nothing is evicted.
        ``keep_pinned`` returns a read lease the caller releases.
        The tiered store's write-back uses that.
        When the key is already cached the assembled copy is a duplicate.
        The slot then goes back on loan and nothing is published.
        """
        cache = self._cache
        pool = cache.pool
        with pool:
            cache._check_open()
            if slot not in self._slots or pool.state(slot) != SEALED:
                raise StaleSlot(f"slot {slot} is not a sealed, lent slot")
            adoption = cache._publish_sealed(slot, keep_pinned=keep_pinned)
            if adoption.published:
                self._slots.discard(slot)
            else:
                pool.lend(slot)
            return adoption

    def recall(self) -> int:
        """Return lent slots that no rank has claimed to the cache. Returns how many came back.

        Claimed or sealed loans stay out, as a rank may still be writing them.
        A later owner's pass adopts or reclaims them.
        """
        cache = self._cache
        pool = cache.pool
        with pool:
            if cache._closed:
                return 0
            idle = [s for s in self._slots if pool.state(s) == LENT]
            for slot in idle:
                self._slots.discard(slot)
                pool.free(slot)
                cache._free.append(slot)
            return len(idle)

    def take_back(self, slot: int) -> None:
        """Return an ABORTED (or unclaimed) lent slot to the loan pool, ready for a new claim."""
        pool = self._cache.pool
        with pool:
            if slot not in self._slots or pool.state(slot) not in (ABORTED, LENT):
                raise StaleSlot(f"slot {slot} is not an aborted, lent slot")
            pool.lend(slot)
