"""The slot handle: one pinned slot of a host pool, written or read in place.

Every way of holding a slot hands out a :class:`Lease`.
A host cache's reservations and read pins do: :meth:`HostCache.reserve` and
:meth:`HostCache.acquire`.
So do a TP rank's claim on a lent slot, :meth:`ShardAssembler.slot_for_write`, and a
rank's read pin, :meth:`ShardAssembler.acquire`.
The holder that handed it out finishes it.
A write lease is committed, which publishes it, or aborted. A read lease is released.
Leases are context managers, so pins go back on every exit path.
Finishing twice is harmless.
"""

from __future__ import annotations

from types import TracebackType
from typing import Protocol

from chunkstore.hashing import ChunkKey


class LeaseHolder(Protocol):
    """What hands out leases and takes them back."""

    def commit(self, lease: Lease) -> object:
        """Publish what was written into a write lease."""
        ...

    def abort(self, lease: Lease) -> None:
        """Give a write lease back unpublished; idempotent."""
        ...

    def release(self, lease: Lease) -> None:
        """Give a read lease back; idempotent."""
        ...


class Lease:
    """A pinned slot: ``view`` stays valid and the slot unevictable until it is finished.

    A write lease's ``view`` is the writable slot.
    For a TP rank's claim it is the chunk buffer whose byte ranges the rank writes.
    A read lease's ``view`` holds exactly the chunk's bytes.
    ``with lease:`` commits a write lease on a clean exit, and aborts it if the block raised.
    It releases a read lease.
    """

    __slots__ = ("_holder", "generation", "key", "released", "sealed", "slot", "view", "writing")

    def __init__(
        self,
        holder: LeaseHolder,
        key: ChunkKey,
        slot: int,
        generation: int,
        view: memoryview,
        *,
        writing: bool,
    ) -> None:
        self._holder = holder
        self.key = key
        """The chunk's key."""
        self.slot = slot
        """Slot number in the pool (hand it, with ``generation``, to another process)."""
        self.generation = generation
        """The slot's generation when leased (detects reuse across processes)."""
        self.view = view
        """The slot's bytes."""
        self.writing = writing
        """True for a write lease (a reservation or a rank's claim)."""
        self.released = False
        """Whether the lease is finished (committed, aborted or released); set by its holder."""
        self.sealed = False
        """For a rank's claim: whether this rank's commit completed and sealed the chunk."""

    def release(self) -> None:
        """Give the pin back; idempotent. For a write lease this aborts it."""
        if self.writing:
            self._holder.abort(self)
        else:
            self._holder.release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.released:
            return
        if self.writing and exc_type is None:
            self._holder.commit(self)
        else:
            self.release()

    def __repr__(self) -> str:
        kind = "write" if self.writing else "read"
        return f"Lease({kind}, key={self.key.hex[:12]}, slot={self.slot}, released={self.released})"
