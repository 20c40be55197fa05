"""Engine-neutral residency events: a chunk entered or left one of this process's tiers."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from chunkstore.hashing import ChunkKey

__all__ = ["ChunkEvent", "ChunkListener", "EventBuffer"]


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """One change of where a chunk is held."""

    key: ChunkKey
    """The chunk."""
    where: str
    """Name of the tier that changed: the host cache's or a secondary tier's."""
    stored: bool
    """True: the tier holds the chunk now. False: it no longer does."""


@runtime_checkable
class ChunkListener(Protocol):
    """Told when a tier stores or drops a chunk.

    Calls come from any thread, some with a cache lock held: an implementation
    must be quick, must not block and must not raise.
    """

    def chunk_stored(self, key: ChunkKey, where: str) -> None: ...

    def chunk_removed(self, key: ChunkKey, where: str) -> None: ...


class EventBuffer:
    """A bounded, thread-safe queue of :class:`ChunkEvent`; a :class:`ChunkListener` itself.

    When full, the oldest event is dropped and counted in :attr:`dropped`: a
    consumer that falls behind loses history, never the caller's time.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"event buffer capacity must be positive, got {capacity}")
        self.capacity = capacity
        """Most events held."""
        self.dropped = 0
        """Events pushed out unread since creation."""
        self._events: deque[ChunkEvent] = deque()
        self._lock = threading.Lock()

    def append(self, event: ChunkEvent) -> None:
        with self._lock:
            if len(self._events) >= self.capacity:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)

    def chunk_stored(self, key: ChunkKey, where: str) -> None:
        self.append(ChunkEvent(key, where, True))

    def chunk_removed(self, key: ChunkKey, where: str) -> None:
        self.append(ChunkEvent(key, where, False))

    def take(self) -> list[ChunkEvent]:
        """Every event since the last call, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
