"""A delete while the chunk's write-back is under way, read again before that write ends.

``delete`` takes back queued write-backs and has one under way undone when it ends. A read
in between may find the landed copy in the tier; it must not promote it into host memory,
where it would outlive the undo and a later ``get`` would serve the deleted chunk (the store
suite's ``test_delete`` met that about once in 40 runs on a local FsStore, in most runs on
JuiceFS, before promotion withheld such chunks).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from chunkstore.backends._memory import MemoryStore
from chunkstore.backends.base import Buffer
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from tests.tiering.test_tiered import make


class LandsWhileWriting(MemoryStore):
    """A tier whose batch write starts on ``start``, stores the chunks (``landed``), and
    returns on ``finish``: the chunks are in the tier while the write is still under way."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.entered, self.start = threading.Event(), threading.Event()
        self.landed, self.finish = threading.Event(), threading.Event()

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self.entered.set()
        if not self.start.wait(timeout=30):
            raise TimeoutError("test gate never opened")
        try:
            return super().put_many(items)
        finally:
            self.landed.set()
            self.finish.wait(timeout=30)


def test_a_deleted_chunk_stays_deleted_when_read_while_its_write_back_lands(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    tier = LandsWhileWriting("disk")
    store = make(4, [tier], metrics)
    key, data = chain[0].key, chain[0].data
    try:
        store.put(key, data)
        assert tier.entered.wait(timeout=30)  # its write-back is under way
        assert store.delete(key) is True
        tier.start.set()
        assert tier.landed.wait(timeout=30)
        store.get(key)  # may still see the landed copy: the delete is undone when the write ends
        tier.finish.set()
        assert store.flush(timeout=30)
        assert not tier.exists(key)  # undone in the tier
        assert store.get(key) is None
    finally:
        tier.start.set()
        tier.finish.set()
        store.close()
