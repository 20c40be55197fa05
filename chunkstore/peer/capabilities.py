"""What a served object may offer beyond the Store interface, as runtime-checkable protocols.

:class:`~chunkstore.peer.server.PeerServer` serves any
:class:`~chunkstore.backends.base.Store`. When the object also pins chunks in
place (a host cache over a fixed-slot pool), the server hands out those slots
directly: NIXL reads them without a copy. Everything here is optional; a plain
store is served through the server's own staging arena.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from chunkstore.hashing import ChunkKey


class PinnedChunk(Protocol):
    """A pin on one slot (HostCache's ``Lease``): ``view`` is stable until it is released."""

    view: memoryview


@runtime_checkable
class SupportsPinning(Protocol):
    """Chunks can be pinned in place and read as stable buffers."""

    def acquire(self, key: ChunkKey) -> Any:
        """Pin ``key``: an object whose ``view`` holds exactly the chunk's bytes and stays
        valid and unchanged until :meth:`release`; ``None`` if absent."""
        ...

    def release(self, lease: Any) -> None:
        """Undo one :meth:`acquire`; idempotent."""
        ...


@runtime_checkable
class SupportsMemoryRegions(Protocol):
    """The memory every pinned buffer lies in, for registration with NIXL once at start."""

    def memory_regions(self) -> Sequence[Any]:
        """Buffers (numpy arrays, memoryviews, mmaps) that contain every view
        :meth:`SupportsPinning.acquire` and :meth:`SupportsReserve.reserve` return;
        they never move or shrink."""
        ...


@runtime_checkable
class SupportsReserve(Protocol):
    """Incoming chunks can be written straight into a slot (no staging copy)."""

    def reserve(self, key: ChunkKey) -> Any:
        """A pinned writable slot for ``key`` (its ``view`` spans the whole slot), invisible
        to readers until :meth:`commit`; ``None`` when there is no room."""
        ...

    def commit(self, lease: Any, length: int | None = None) -> None:
        """Publish ``length`` bytes of a reserved slot."""
        ...

    def abort(self, lease: Any) -> None:
        """Give a reserved slot back without publishing it."""
        ...


def capacity_of(store: Any) -> tuple[int, int] | None:
    """(capacity, used) bytes when the object reports them (HostCache, TieredStore), else None."""
    capacity = getattr(store, "capacity_bytes", None)
    if capacity is None and hasattr(store, "host"):
        capacity = getattr(store.host, "capacity_bytes", None)
    if not isinstance(capacity, int):
        return None
    used = getattr(store, "used_bytes", None)
    if not isinstance(used, int):
        stats = getattr(store, "stats", None)
        snapshot = stats() if callable(stats) else None
        used = getattr(snapshot, "bytes_used", None)
        if used is None:
            used = getattr(getattr(snapshot, "host", None), "bytes_used", None)
    if not isinstance(used, int):
        return None
    return capacity, used


def address_of(buffer: Any) -> tuple[int, int]:
    """(address, length) of a contiguous buffer, without copying it."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return int(array.ctypes.data), int(array.nbytes)
