"""One chunk of a load job: its key, its buffer and the reads that may still write into it.

A load job of :class:`~chunkstore.vllm.native.tier.ChunkStoreTier` reads ahead.
It starts the reads of its next chunks before it scatters the current chunk
into its primary slot. The reads run on the stores' guard threads. The store
checks the checksum there too. Each read is a
:class:`~chunkstore.tiering._tierlist.TierRead` of the tier's
:class:`~chunkstore.tiering._tierlist.TierList`, taken in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from chunkstore.hashing import ChunkKey
from chunkstore.tiering import ChunkBuffers
from chunkstore.tiering._tierlist import TierRead

__all__ = ["LoadJobChunk"]


class LoadJobChunk:
    """One chunk of a load job, read into one of the tier's buffers and then scattered."""

    __slots__ = ("key", "buffers", "pending", "read", "_pool", "_give_permit")

    def __init__(self, key: ChunkKey, pool: ChunkBuffers, give_permit: Callable[[], None]) -> None:
        self.key = key
        self._pool = pool
        self._give_permit = give_permit
        self.buffers = pool.take(1)
        """The chunk's buffer in a one-item list, the form the stores' batch reads take."""
        self.pending: list[Future[Any]] = []
        """Calls that timed out but still run; they may still write into the buffer."""
        self.read: TierRead | None = None
        """The read started and not yet taken."""

    def close(self) -> None:
        """Give the buffer back once nothing writes into it any more.

        A read may start but never be taken, because the job ended first. If it
        is still queued, it is cancelled. If it already runs, it keeps the
        buffer until it ends.
        """
        running = []
        if self.read is not None and not self.read.call.future.cancel():
            running.append(self.read.call.future)
        self.read = None
        self._pool.release_after(self.pending + running, self.buffers)
        self._give_permit()
