"""One chunk on its way to the tier's stores: its writes, its buffer and its permit.

A store job of :class:`~chunkstore.vllm.native.tier.ChunkStoreTier` converts its
chunks one after another. Once a chunk is sealed, the job starts its writes.
Each store gets one guarded call. The job then takes the results in order. A
:class:`ChunkWriting` is one such chunk. It holds the buffer the writes read.
It also holds one permit of the tier's bound on chunks in flight. Both go back
when its last write ends. The next chunk of any job can then start. The permit
may go back earlier, when the job settles a write that timed out. Such a write
may still run. It keeps its buffer until it ends. The permit goes back once,
on whichever comes first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from chunkstore.tiering._tierlist import TierWrites

__all__ = ["ChunkWriting"]


class ChunkWriting:
    """One chunk whose writes are under way; the module docstring has the rules."""

    __slots__ = ("writes", "_give_permit", "_give_buffer", "_running", "_holds_permit", "_lock")

    def __init__(self, give_permit: Callable[[], None], give_buffer: Callable[[], None]) -> None:
        self.writes: TierWrites | None = None
        """The writes to every store, once made."""
        self._give_permit = give_permit
        # The buffer goes back before the permit. Chunks in flight then hold no more buffers
        # than there are permits. A call that timed out keeps its buffer until it ends.
        self._give_buffer = give_buffer
        # Calls not ended, plus one until every call is registered.
        self._running = 1
        self._holds_permit = True
        self._lock = threading.Lock()

    def all_started(self) -> None:
        """Note that :attr:`writes` started; buffer and permit go back once all end."""
        assert self.writes is not None
        for future in self.writes.futures():
            with self._lock:
                self._running += 1
            future.add_done_callback(self._ended)
        self._ended(None)

    def _ended(self, _future: Future[Any] | None) -> None:
        with self._lock:
            self._running -= 1
            done = self._running == 0
        if done:
            self._give_buffer()
            self.release()

    def release(self) -> None:
        """Give the permit back once, when the writes end or are settled."""
        with self._lock:
            holds, self._holds_permit = self._holds_permit, False
        if holds:
            self._give_permit()

    def futures(self) -> list[Future[Any]]:
        """The writes started. They are done once nothing reads the buffer any more."""
        return [] if self.writes is None else self.writes.futures()
