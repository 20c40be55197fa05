"""The peer server's NIXL side: its agent, the staging arena, and moving chunks through them.

Clients read a store that pins chunks in registered memory in place.
A host cache is such a store.
Anything else is copied into the staging arena first, which is registered once at start.
Pushed chunks are READ from the client straight into a reserved host slot, if the store
offers one.
They are verified there, then committed.
Otherwise they go through the arena.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from chunkstore.backends.base import Store, SupportsMemoryRegions, SupportsPinning, SupportsReserve
from chunkstore.hashing import ChunkKey
from chunkstore.peer._arena import Allocation, Arena
from chunkstore.peer._nixlplane import NixlEndpoint, address_of, nixl_unavailable_reason

Items = list[list[int] | None]
"""Per key: ``[address, size]`` a client may READ, or ``None`` (a miss)."""


class NixlStaging:
    """The server's NIXL agent and its staging arena (both registered at start)."""

    def __init__(self, endpoint: NixlEndpoint, arena: Arena) -> None:
        self.endpoint = endpoint
        """The server's NIXL agent."""
        self.arena = arena
        """Staging memory for chunks of stores that cannot pin in place."""

    @classmethod
    def open(cls, store: Store, staging_bytes: int) -> tuple[NixlStaging | None, str | None]:
        """The staging for serving ``store``, or ``None`` and why NIXL cannot be offered."""
        reason = nixl_unavailable_reason()
        if reason is not None:
            return None, reason
        try:
            endpoint = NixlEndpoint("server")
            arena = Arena(staging_bytes)
            endpoint.register(arena.array)
            if isinstance(store, SupportsMemoryRegions):
                for region in store.memory_regions():
                    endpoint.register(region)
        except Exception as exc:  # noqa: BLE001 - the server falls back to the inline plane
            return None, f"NIXL could not start: {exc}"
        return cls(endpoint, arena), None

    def close(self) -> None:
        """Deregister everything and drop the agent."""
        self.endpoint.close()

    # --- transfers ------------------------------------------------------------------------

    def lend(
        self,
        keys: list[ChunkKey],
        *,
        pinning: SupportsPinning | None,
        read: Callable[[list[ChunkKey]], Sequence[Any]],
        count: Callable[[str], None],
    ) -> tuple[Items, list[Callable[[], None]]]:
        """Where a client can READ each chunk, and the calls that give the memory back.

        With ``pinning``, chunks in registered memory are pinned in place: ``served_in_place``.
        Others are copied to the arena and unpinned at once.
        Without it, ``read`` fetches them and they are staged.
        A full arena is a miss, counted as ``staging_full``.
        """
        items: Items = []
        releases: list[Callable[[], None]] = []
        pending: list[int] = []  # indices that go through the staging arena
        if pinning is not None:
            for i, key in enumerate(keys):
                pin = pinning.acquire(key)
                if pin is None:
                    items.append(None)
                    continue
                address, size = address_of(pin.view)
                if self.endpoint.registered(address, size):
                    count("served_in_place")
                    items.append([address, size])
                    releases.append(partial(pinning.release, pin))
                    continue
                items.append(None)  # not in a registered pool: stage a copy, unpin at once
                try:
                    allocation = self.stage(pin.view)
                finally:
                    pinning.release(pin)
                if allocation is None:
                    count("staging_full")
                    continue
                items[i] = [self.arena.address_of(allocation), size]
                releases.append(partial(self.arena.free, allocation))
        else:
            items = [None] * len(keys)
            pending = list(range(len(keys)))
        if pending:
            blobs = read([keys[i] for i in pending])
            for i, blob in zip(pending, blobs):
                if blob is None:
                    continue
                allocation = self.stage(blob)
                if allocation is None:
                    count("staging_full")
                    continue
                items[i] = [self.arena.address_of(allocation), len(blob)]
                releases.append(partial(self.arena.free, allocation))
        return items, releases

    def stage(self, blob: Any) -> Allocation | None:
        """A copy of ``blob`` in the arena. ``None`` when the arena is full."""
        allocation = self.arena.allocate(len(blob))
        if allocation is not None:
            self.arena.view(allocation)[:] = memoryview(blob).cast("B")
        return allocation

    def pull(
        self,
        remote: str,
        keys: list[ChunkKey],
        sizes: list[int],
        addrs: list[int],
        todo: list[int],
        blobs: list[Any],
        *,
        reserving: SupportsReserve | None,
        valid: Callable[[ChunkKey, Any], bool],
        deadline: float,
        count: Callable[[str], None],
    ) -> list[int]:
        """READ pushed chunks, the ``todo`` indices, from the client agent ``remote``.

        They go straight into reserved slots where ``reserving`` offers them.
        There they are checked with ``valid``, then committed.
        Returns those indices.
        Others go via the arena into ``blobs``.
        """
        committed: list[int] = []
        for i in todo:
            key, address, size = keys[i], addrs[i], sizes[i]
            lease = reserving.reserve(key) if reserving is not None else None
            if lease is not None:
                assert reserving is not None
                slot = lease.view
                local, room = address_of(slot)
                if room >= size and self.endpoint.registered(local, size):
                    ok = self.endpoint.read(remote, [(local, address, size)], deadline)
                    if ok and valid(key, slot[:size]):
                        reserving.commit(lease, size)
                        committed.append(i)
                    else:
                        reserving.abort(lease)
                    continue
                reserving.abort(lease)
            allocation = self.arena.allocate(size)
            if allocation is None:
                count("staging_full")
                continue
            try:
                if self.endpoint.read(
                    remote, [(self.arena.address_of(allocation), address, size)], deadline
                ):
                    blobs[i] = bytes(self.arena.view(allocation))
            finally:
                self.arena.free(allocation)
        return committed
