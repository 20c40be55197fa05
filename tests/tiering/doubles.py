"""Secondary tiers that misbehave on demand: broken, slow, gated."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from chunkstore.backends._memory import MemoryStore
from chunkstore.backends.base import Buffer
from chunkstore.cache import HostCache
from chunkstore.hashing import ChunkKey
from chunkstore.testing.factories import MadeChunk


class FlakyStore(MemoryStore):
    """A memory store that raises ``OSError`` from every call while ``broken`` is set."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.broken = False
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        if self.broken:
            raise OSError("simulated outage")

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        self._check()
        return super()._read_many(keys)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check()
        return super().exists_many(keys)

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self._check()
        return super().put_many(items)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        self._check()
        return super().delete_many(keys)


class GatedStore(MemoryStore):
    """Writes wait for ``gate``; ``entered`` is set when the first write is waiting.

    A write copies its input only after the gate opened (as a slow tier
    reads it late), then sets ``finished``.
    """

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.finished = threading.Event()

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("test gate never opened")
        try:
            return super().put_many(items)
        finally:
            self.finished.set()


class DirectStore(MemoryStore):
    """A memory store with the zero-copy ``get_into`` fast path (like FsStore)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.direct_reads = 0
        """``get_into`` calls (reads straight into the caller's memory)."""

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        self.direct_reads += 1
        data = self._lookup(key)
        if data is None:
            return None
        target = memoryview(buffer).cast("B")
        if len(target) < len(data):
            return None
        target[: len(data)] = data
        return len(data)

    def _lookup(self, key: ChunkKey) -> bytes | None:
        return super()._read_many([key])[0]


class FarDirectStore(DirectStore):
    """A round-trip-bound store (``high_latency``) that still offers ``get_into``."""

    kind = "far"

    @property
    def high_latency(self) -> bool:
        return True


class StallingStore(DirectStore):
    """Reads block until ``release`` is set: a tier that stopped answering.

    A stalled read still completes once released: ``get_into`` then writes
    the chunk into the buffer it was given long ago, and ``finished`` is set
    after each stalled read returned its data. ``stall_lookups=False`` answers
    ``exists`` / ``lookup_prefix`` at once (only the data path hangs).
    """

    def __init__(self, name: str, *, stall_lookups: bool = True) -> None:
        super().__init__(name=name)
        self.release = threading.Event()
        self.finished = threading.Event()
        self.stall_lookups = stall_lookups

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        self.release.wait(timeout=30)
        try:
            return super()._read_many(keys)
        finally:
            self.finished.set()

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        self.release.wait(timeout=30)
        try:
            return super().get_into(key, buffer)
        finally:
            self.finished.set()

    def _lookup(self, key: ChunkKey) -> bytes | None:
        return MemoryStore._read_many(self, [key])[0]

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if self.stall_lookups:
            self.release.wait(timeout=30)
        return super().exists_many(keys)


class StallingSetAside(MemoryStore):
    """An unverified store whose set-aside of a corrupt chunk waits for ``release``: a tier
    that stalls in it. ``began`` is set when one is waiting; ``events`` gets ``"set aside"``
    when one goes on (tests add their own entries to order it against)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, verify=False)
        self.release = threading.Event()
        self.began = threading.Event()
        self.events: list[str] = []

    def _quarantine(self, key: ChunkKey, reason: str) -> str:
        self.began.set()
        self.release.wait(timeout=10)  # bounded: a read that waits for it fails, not hangs
        self.events.append("set aside")
        return super()._quarantine(key, reason)


class VerifyTurnedOnDuringRead(MemoryStore):
    """A store whose ``verify`` is turned on while a read that did not check is returning."""

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        found = super().get_many(keys)
        self.verify = True
        return found


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds (a background callback's effect); fail after 30 s."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def cache_chunks(host: HostCache, chunks: Sequence[MadeChunk]) -> list[MadeChunk]:
    """Put ``chunks`` into ``host`` in order; those it holds afterwards (checked intact).

    Used while a stalled tier call still holds (or once held) a host slot: if
    that slot had been given back early, one of these chunks lands in it and
    is overwritten when the stalled call ends (see :func:`assert_intact`).
    """
    for chunk in chunks:
        host.put(chunk.key, chunk.data)
    held = [chunk for chunk in chunks if host.exists(chunk.key)]
    assert held, "host memory took none of the chunks"
    assert_intact(host, held)
    return held


def assert_intact(host: HostCache, chunks: Sequence[MadeChunk]) -> None:
    """Every one of ``chunks`` is still in ``host`` with exactly its own bytes."""
    for chunk in chunks:
        assert host.get(chunk.key) == chunk.data, f"slot of {chunk.key.hex[:12]} was overwritten"
