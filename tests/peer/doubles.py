"""Test doubles for the peer tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.hashing import ChunkKey


class RegisteredHostCache(HostCache):
    """A HostCache that reports its pool memory, so a peer server registers it with NIXL and
    serves slots in place (the capability the cache is asked to provide natively)."""

    def memory_regions(self) -> list[Any]:
        native = getattr(super(), "memory_regions", None)
        if native is not None:
            return list(native())
        return [self.pool._buf]  # noqa: SLF001 - until HostCache offers memory_regions()


class SlowStore(MemoryStore):
    """A memory store whose reads block until ``unblock`` is set (a stalled peer)."""

    def __init__(self) -> None:
        super().__init__()
        self.unblock = threading.Event()
        self.reading = threading.Event()
        self.reads = 0

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        self.reads += 1
        self.reading.set()
        self.unblock.wait(30)
        return super()._read_many(keys)


class SlowAnswers:
    """Makes a running server answer every request ``delay_s`` late (a peer that answers each
    request just inside the client's timeout); ``asked`` lists the ops it received, in order."""

    def __init__(self, server: Any, delay_s: float) -> None:
        self.asked: list[str] = []
        handlers = server._handlers  # noqa: SLF001 - the server has no hook for slowness
        handle = handlers.handle

        def answer(body: dict[str, Any], *args: Any) -> Any:
            self.asked.append(body["op"])
            time.sleep(delay_s)
            return handle(body, *args)

        handlers.handle = answer
