"""Secondary tiers that misbehave on demand: broken, slow, gated."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from chunkstore.backends.base import Buffer
from chunkstore.backends.memory import MemoryStore
from chunkstore.hashing import ChunkKey


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
    """Writes wait for ``gate``; ``entered`` is set when the first write is waiting."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self.entered.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("test gate never opened")
        return super().put_many(items)


class StallingStore(MemoryStore):
    """Reads block until ``release`` is set: a tier that stopped answering."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.release = threading.Event()

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        self.release.wait(timeout=30)
        return super()._read_many(keys)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.release.wait(timeout=30)
        return super().exists_many(keys)
