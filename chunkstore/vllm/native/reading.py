"""Reads started on the tier's stores and taken later: :class:`StoreRead`, :class:`LoadJobChunk`.

A load job of :class:`~chunkstore.vllm.native.tier.ChunkStoreTier` starts the
reads of its next chunks (guarded calls, on the stores' guard threads, where the
store also checks the checksum) before it scatters the current chunk into its
primary slot, and takes each read's :meth:`StoreRead.result` in turn. A
:class:`StoreRead` is one such call: which keys it asked for, where their
bytes land, and when it ended (its duration for the read metrics is the
store's, not the time the job spent scattering before it looked). A
:class:`LoadJobChunk` is one chunk of a load job: its key, its buffer, and the
calls that may still write into that buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from chunkstore.hashing import ChunkKey
from chunkstore.tiering._guard import GuardedCall, GuardedTier
from chunkstore.vllm.native.buffers import ChunkBuffers

__all__ = ["LoadJobChunk", "StoreRead"]


class StoreRead:
    """One store's read of some of a job's keys, under way (see the module docstring)."""

    __slots__ = ("index", "tier", "asked", "call", "verified", "_views")

    def __init__(
        self,
        index: int,
        tier: GuardedTier,
        asked: list[int],
        call: GuardedCall[Any],
        views: list[memoryview] | None,
        verified: bool,
    ) -> None:
        self.index = index
        """The store's place in the tier's order (a key it misses is asked of the next)."""
        self.tier = tier
        self.asked = asked
        """Positions of the keys asked for, in the job's list."""
        self.call = call
        self.verified = verified
        """The store's ``verify`` as the read began: whether it checked what it returns
        (read afterwards, a flag turned on meanwhile would vouch for unchecked bytes)."""
        self._views = views

    @property
    def into_buffers(self) -> bool:
        """Whether the store reads into the job's buffers (else into memory of its own)."""
        return self._views is not None

    def result(self) -> list[Any]:
        """Each asked key's bytes (None where the store has no good copy); raises
        :class:`~chunkstore.tiering._guard.TierUnavailable` as a guarded call does."""
        got = self.call.result()
        if self._views is None:
            return list(got)
        return [None if n is None else view[:n] for n, view in zip(got, self._views)]


class LoadJobChunk:
    """One chunk of a load job: read into a buffer of the tier's, then scattered."""

    __slots__ = ("key", "buffers", "pending", "read", "_pool", "_give_permit")

    def __init__(self, key: ChunkKey, pool: ChunkBuffers, give_permit: Callable[[], None]) -> None:
        self.key = key
        self._pool = pool
        self._give_permit = give_permit
        self.buffers = pool.take(1)
        """The chunk's buffer (a list, as the stores' batch reads take them)."""
        self.pending: list[Future[Any]] = []
        """Calls that timed out but still run, and may still write into the buffer."""
        self.read: StoreRead | None = None
        """The read started and not yet taken."""

    def close(self) -> None:
        """Give the buffer back once nothing writes into it any more. A read started but
        never taken (the job ended before it) is cancelled if it is still queued; one
        already running keeps the buffer until it ends."""
        running = []
        if self.read is not None and not self.read.call.future.cancel():
            running.append(self.read.call.future)
        self.read = None
        self._pool.release_after(self.pending + running, self.buffers)
        self._give_permit()
