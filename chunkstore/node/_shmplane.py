"""The node service's shared-memory data plane (``shm``): slots of one pool that clients map.

The node service serves a host cache whose slot pool lives in ``/dev/shm``.
The engines of the machine map the same pool.

A read names slots instead of sending bytes. The server pins each chunk's slot
*on the client's behalf*. The pin is the server's. It is released when the
lease ends or the client's connection closes, so a killed client leaks nothing.
The server replies ``[slot, generation, size]``, and the client copies straight
out of its mapping.

A write reserves slots the client fills in place. On commit the server checks
every chunk before it is published and queued for write-behind. The socket is
the trust boundary, and a client may be buggy. The ranks of a TP engine reserve
the same slot, one part each. See :class:`~chunkstore.cache.assembly.NodeAssemblies`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from chunkstore.backends.base import Store, SupportsPinning, SupportsReserve
from chunkstore.cache._lease import Lease
from chunkstore.cache._pool import SlotPool
from chunkstore.cache.assembly import NodeAssemblies, RankPart
from chunkstore.format import ChunkLayout
from chunkstore.hashing import ChunkKey
from chunkstore.peer import _protocol as P
from chunkstore.peer._errors import ProtocolViolation
from chunkstore.peer._handlers import Validity
from chunkstore.peer._sessions import Session

Items = list[list[int] | None]
"""Per key: ``[slot, generation, size]`` (reads) or ``[slot, generation]`` (reservations),
or ``None``."""


def shared_pool_of(store: Store) -> SlotPool | None:
    """The named shared slot pool behind ``store``, or ``None`` when its pool is private or
    it has none. ``store`` is a host cache, or a tiered store with a host cache."""
    host = getattr(store, "host", store)
    pool = getattr(host, "pool", None)
    if isinstance(pool, SlotPool) and pool.name is not None:
        return pool
    return None


class ShmPlane:
    """Reads and writes of one store through its shared slot pool. This is a
    :class:`~chunkstore.peer._handlers.SlotPlane`.

    ``valid`` checks each committed chunk. ``seal_layout`` is the served model's chunk
    layout. With it, the ranks of TP engines write parts of one chunk, sealed here.
    """

    def __init__(
        self,
        store: Store,
        pool: SlotPool,
        *,
        valid: Validity,
        seal_layout: ChunkLayout | None = None,
    ) -> None:
        if not isinstance(store, SupportsPinning) or not isinstance(store, SupportsReserve):
            raise TypeError("the shm plane needs a store that pins and reserves host slots")
        self._pinning: SupportsPinning = store
        self._reserving: SupportsReserve = store
        self._valid = valid
        self._assemblies = (
            NodeAssemblies(store, seal_layout, valid) if seal_layout is not None else None
        )
        self.pool = pool
        """The shared pool clients map."""

    @classmethod
    def open(
        cls, store: Store, *, valid: Validity, seal_layout: ChunkLayout | None = None
    ) -> tuple[ShmPlane | None, str | None]:
        """The plane over ``store``, or ``None`` and why it cannot be offered."""
        pool = shared_pool_of(store)
        if pool is None:
            return None, "the host cache is not in shared memory (give it an shm name)"
        if not isinstance(store, SupportsPinning) or not isinstance(store, SupportsReserve):
            return None, f"a {type(store).__name__} cannot pin or reserve host slots"
        return cls(store, pool, valid=valid, seal_layout=seal_layout), None

    def hello_fields(self, slot_size: int | None) -> dict[str, Any]:
        """What a client needs to map the pool: its name and geometry. A node client's
        chunks of ``slot_size`` bytes must be the size of the pool's slots. One chunk
        fills one slot."""
        served = self.pool.slot_size
        if slot_size is not None and slot_size != served:
            raise ProtocolViolation(
                P.GEOMETRY_MISMATCH,
                f"this node's pool has {served}-byte slots, the client's chunks are "
                f"{slot_size} bytes (other model, dtype or chunk size)",
            )
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
        self, body: dict[str, Any], keys: list[ChunkKey], present: list[bool], owner: Session
    ) -> tuple[list[Any], list[Any], list[Callable[[], None]]]:
        """A writable slot per key not ``present``; ``None`` when there is no room. This
        serves the ``reserve`` request ``body`` of session ``owner``. A slot holds a whole
        chunk. With ``tp`` > 1 it holds a TP rank's part of one shared by its engine's
        ranks."""
        if body.get("tp", 1) > 1:
            return self._reserve_parts(body, keys, present, owner)
        items, leases, releases = self._reserve_whole(keys, present)
        return list(items), list(leases), releases

    def _reserve_whole(
        self, keys: Sequence[ChunkKey], present: Sequence[bool]
    ) -> tuple[Items, list[Lease | None], list[Callable[[], None]]]:
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

    def _reserve_parts(
        self, body: dict[str, Any], keys: list[ChunkKey], present: list[bool], owner: Session
    ) -> tuple[list[Any], list[Any], list[Callable[[], None]]]:
        """A TP rank's reservations: the shared slot of each chunk it writes a part of."""
        if self._assemblies is None:
            raise ProtocolViolation(
                P.DATAPLANE_UNAVAILABLE,
                "this node cannot assemble TP chunks (start it with the model's --spec)",
            )
        tp, rank = body["tp"], body.get("rank", -1)
        parents, tokens = body.get("parents"), body.get("tokens")
        if not 0 <= rank < tp or parents is None or tokens is None:
            raise ProtocolViolation(P.MALFORMED, "reserve: tp needs a rank below it")
        if len(parents) != 32 * len(keys) or len(tokens) != len(keys):
            raise ProtocolViolation(P.MALFORMED, "reserve: one parent and token list per key")
        engine = body.get("engine")
        items: list[Any] = []
        held: list[Any] = []
        releases: list[Callable[[], None]] = []
        for i, (key, here) in enumerate(zip(keys, present)):
            part = RankPart(key, rank, engine)
            ids = np.frombuffer(tokens[i], dtype="<u4").tolist()
            item = (
                None
                if here
                else self._assemblies.join(
                    part,
                    tp=tp,
                    parent=parents[32 * i : 32 * i + 32],
                    tokens=ids,
                    owner=owner,
                )
            )
            items.append(item)
            held.append(part if item is not None else None)
            if item is not None:
                releases.append(partial(self._assemblies.leave, part))
        return items, held, releases

    def commit(self, held: list[Any], sizes: list[int]) -> list[bool]:
        """Publish what a reservation holds. Size 0 is the client giving the slot back.
        Per key: stored. A TP rank's part counts as stored once accepted into its chunk."""
        if any(isinstance(part, RankPart) for part in held):
            return self._commit_parts(held, sizes)
        return self._commit_whole(held, sizes)

    def _commit_whole(self, leases: Sequence[Lease | None], sizes: Sequence[int]) -> list[bool]:
        """Publish each reservation whose chunk of ``sizes[i]`` bytes is valid; abort the
        others."""
        stored: list[bool] = []
        for lease, size in zip(leases, sizes):
            if lease is None:
                stored.append(False)
                continue
            if not 0 < size <= len(lease.view) or not self._valid(lease.key, lease.view[:size]):
                self._reserving.abort(lease)
                stored.append(False)
                continue
            self._reserving.commit(lease, size)
            stored.append(True)
        return stored

    def _commit_parts(self, parts: list[Any], sizes: list[int]) -> list[bool]:
        """A TP rank's parts are written with size > 0, or given up with 0. Per part: accepted."""
        assert self._assemblies is not None  # parts exist only with assemblies
        stored = []
        for part, size in zip(parts, sizes):
            if not isinstance(part, RankPart):
                stored.append(False)
            elif size == 0:
                self._assemblies.leave(part)
                stored.append(False)
            else:
                stored.append(self._assemblies.part_done(part))
        return stored

    def session_ended(self, session: Session) -> None:
        """Give up the TP chunks ``session``'s rank joined and that are not whole yet."""
        if self._assemblies is not None:
            self._assemblies.owner_gone(session)


__all__ = ["ShmPlane", "shared_pool_of"]
