"""The server's shared-memory data plane (``shm``): slots of one pool that clients map.

The node service serves a host cache whose slot pool lives in ``/dev/shm``;
the engines of the machine map the same pool. A read names slots instead of
sending bytes: the server pins each chunk's slot *on the client's behalf*
(the pin is the server's, released when the lease ends or the client's
connection closes, so a killed client leaks nothing) and replies
``[slot, generation, size]``; the client copies straight out of its mapping.
A write reserves slots the client fills in place; on commit the server
checks every chunk (the socket is the trust boundary: a client may be buggy)
before it is published and queued for write-behind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from chunkstore.backends.base import Store, SupportsPinning, SupportsReserve
from chunkstore.cache._lease import Lease
from chunkstore.cache._pool import SlotPool
from chunkstore.hashing import ChunkKey

Items = list[list[int] | None]
"""Per key: ``[slot, generation, size]`` (reads) or ``[slot, generation]`` (reservations),
or ``None``."""


def shared_pool_of(store: Store) -> SlotPool | None:
    """The named shared slot pool behind ``store`` (a host cache, or a tiered store's host
    cache), or ``None`` when its pool is private or it has none."""
    host = getattr(store, "host", store)
    pool = getattr(host, "pool", None)
    if isinstance(pool, SlotPool) and pool.name is not None:
        return pool
    return None


class ShmPlane:
    """Reads and writes of one store through its shared slot pool."""

    def __init__(self, store: Store, pool: SlotPool) -> None:
        if not isinstance(store, SupportsPinning) or not isinstance(store, SupportsReserve):
            raise TypeError("the shm plane needs a store that pins and reserves host slots")
        self._pinning: SupportsPinning = store
        self._reserving: SupportsReserve = store
        self.pool = pool
        """The shared pool clients map."""

    @classmethod
    def open(cls, store: Store) -> tuple[ShmPlane | None, str | None]:
        """The plane over ``store``, or ``None`` and why it cannot be offered."""
        pool = shared_pool_of(store)
        if pool is None:
            return None, "the host cache is not in shared memory (give it an shm name)"
        if not isinstance(store, SupportsPinning) or not isinstance(store, SupportsReserve):
            return None, f"a {type(store).__name__} cannot pin or reserve host slots"
        return cls(store, pool), None

    def hello_fields(self) -> dict[str, Any]:
        """What a client needs to map the pool: its name and geometry."""
        return {
            "pool": self.pool.name,
            "slot_size": self.pool.slot_size,
            "num_slots": self.pool.num_slots,
        }

    def lend(self, keys: Sequence[ChunkKey]) -> tuple[Items, list[Callable[[], None]]]:
        """Pin each held chunk in its slot; the items and the calls that unpin them."""
        items: Items = []
        releases: list[Callable[[], None]] = []
        for key in keys:
            pin = self._pinning.acquire(key)
            if pin is None:
                items.append(None)
                continue
            if not isinstance(pin, Lease):  # not a slot of the pool: nothing a client can map
                self._pinning.release(pin)
                items.append(None)
                continue
            items.append([pin.slot, pin.generation, len(pin.view)])
            releases.append(partial(self._pinning.release, pin))
        return items, releases

    def reserve(
        self, keys: Sequence[ChunkKey], present: Sequence[bool]
    ) -> tuple[Items, list[Lease | None], list[Callable[[], None]]]:
        """A writable slot per key not ``present`` (``None`` when there is no room)."""
        items: Items = []
        leases: list[Lease | None] = []
        releases: list[Callable[[], None]] = []
        for key, here in zip(keys, present):
            lease = None if here else self._reserving.reserve(key)
            if lease is not None and not isinstance(lease, Lease):
                self._reserving.abort(lease)
                lease = None
            leases.append(lease)
            if lease is None:
                items.append(None)
                continue
            items.append([lease.slot, lease.generation])
            releases.append(partial(self._reserving.abort, lease))
        return items, leases, releases

    def commit(
        self,
        leases: Sequence[Lease | None],
        sizes: Sequence[int],
        valid: Callable[[ChunkKey, Any], bool],
    ) -> list[bool]:
        """Publish each reservation whose chunk of ``sizes[i]`` bytes passes ``valid``;
        abort the others (size 0 is the client giving the slot back). Per key: stored."""
        stored: list[bool] = []
        for lease, size in zip(leases, sizes):
            if lease is None:
                stored.append(False)
                continue
            if not 0 < size <= len(lease.view) or not valid(lease.key, lease.view[:size]):
                self._reserving.abort(lease)
                stored.append(False)
                continue
            self._reserving.commit(lease, size)
            stored.append(True)
        return stored


__all__ = ["ShmPlane", "shared_pool_of"]
