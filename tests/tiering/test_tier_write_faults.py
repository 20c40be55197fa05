"""A full or read-only tier keeps serving reads; an unparsable entry never marks a tier down.

Faults are injected (no tmpfs to fill, and chmod does not stop root): the store's
writes raise the OSError a full disk (ENOSPC), a read-only mount (EROFS) or a
denied directory (EACCES) raises, under a steady mix of saves and reads.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from chunkstore.backends._fs import FsStore
from chunkstore.backends._memory import MemoryStore
from chunkstore.backends.base import Buffer, ChunkInfo, Store
from chunkstore.cache import HostCache
from chunkstore.errors import KeyParseError
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk, sample_chunks
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT

FAULTS = {
    "disk_full": errno.ENOSPC,
    "read_only": errno.EROFS,
    "denied": errno.EACCES,
}


def fault(code: int) -> OSError:
    """The exception the OS raises for ``code`` (PermissionError for EACCES, as Python does)."""
    return OSError(code, os.strerror(code))


class UnwritableStore(MemoryStore):
    """A memory store whose writes raise ``fault`` once ``broken`` is set; reads work."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.fault: OSError | None = None

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        if self.fault is not None:
            raise self.fault
        return super().put_many(items)

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        if self.fault is not None:
            raise self.fault
        return super().put_if_absent_many(items)


def _memory_tier(tmp_path: Path) -> tuple[Store, Callable[[OSError], None]]:
    store = UnwritableStore("disk")

    def inject(error: OSError) -> None:
        store.fault = error

    return store, inject


def _fs_tier(tmp_path: Path) -> tuple[Store, Callable[[OSError], None]]:
    # A real FsStore: it re-wraps the OSError in a StoreError, the guard must see through it.
    store = FsStore(str(tmp_path / "disk"), create=True)

    def inject(error: OSError) -> None:
        def refuse(*args: Any) -> str:
            raise error

        store.io.write_temp = refuse  # type: ignore[method-assign]

    return store, inject


TIERS = {"memory": _memory_tier, "fs": _fs_tier}


@pytest.fixture
def chain() -> list[MadeChunk]:
    return sample_chunks(24, seed=33, layout=LAYOUT)


@pytest.mark.parametrize("tier_kind", sorted(TIERS))
@pytest.mark.parametrize("fault_name", sorted(FAULTS))
def test_write_fault_keeps_reads_of_stored_chunks_hitting(
    tmp_path: Path, chain: list[MadeChunk], tier_kind: str, fault_name: str
) -> None:
    tier, inject = TIERS[tier_kind](tmp_path)
    stored, later = chain[:8], chain[8:]
    tier.put_many([(c.key, c.data) for c in stored])
    metrics = ChunkstoreMetrics(CollectorRegistry())
    # Two host slots: nearly every read of a stored chunk has to come from the tier.
    store = TieredStore(HostCache(LAYOUT, num_slots=2), [tier], metrics=metrics, retry_after=3600.0)
    try:
        inject(fault(FAULTS[fault_name]))
        reads = hits = 0
        for i, chunk in enumerate(later):  # steady saves, each followed by reads
            store.put(chunk.key, chunk.data)
            assert store.flush(timeout=30)
            for old in (stored[i % len(stored)], stored[(i + 3) % len(stored)]):
                reads += 1
                hits += store.get(old.key) == old.data
        assert hits == reads  # every stored chunk still read from the tier
        assert store.lookup_prefix([c.key for c in stored]) == len(stored)
        tier_stats = store.stats().tiers[0]
        assert tier_stats.up is True
        assert store.tiers[0].writable is False
        # the first save failed and backed writes off; the others were dropped at once
        assert tier_stats.errors == 1
        assert tier_stats.dropped == {"tier_error": 1, "tier_down": len(later) - 1}
        up = metrics.registry.get_sample_value("chunkstore_tier_up", {"tier": tier.name})
        assert up == 1.0
        # nothing was lost: the chunks that could not be written are still in host memory
        # for as long as it holds them, and reported as dropped
        assert store.dropped_keys()[-1] == later[-1].key
    finally:
        store.close()


def test_an_outage_still_stops_reads_and_writes(chain: list[MadeChunk]) -> None:
    now = [0.0]
    tier = UnwritableStore("disk")
    tier.put_many([(c.key, c.data) for c in chain[:4]])
    store = TieredStore(
        HostCache(LAYOUT, num_slots=2),
        [tier],
        metrics=ChunkstoreMetrics(CollectorRegistry()),
        retry_after=60.0,
        clock=lambda: now[0],
    )
    try:
        tier.fault = ConnectionResetError(errno.ECONNRESET, "connection reset")  # not "full"
        store.put(chain[5].key, chain[5].data)
        assert store.flush(timeout=30)
        assert store.tiers[0].writable is False and store.tiers[0].up is False
        now[0] += 61.0
        tier.fault = None
        assert store.get(chain[0].key) == chain[0].data  # back-off over: read again
        assert store.tiers[0].up is True
    finally:
        store.close()


class ForeignEntryStore(MemoryStore):
    """A store whose listing stumbles over one entry whose name is not a key."""

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        yield from super().list(namespace)
        raise KeyParseError("not a chunk key (need 64 lower-case hex digits): 'notes.txt'")


def test_an_unparsable_entry_never_marks_a_tier_down(chain: list[MadeChunk]) -> None:
    tier = ForeignEntryStore(name="disk")
    tier.put_many([(c.key, c.data) for c in chain[:4]])
    metrics = ChunkstoreMetrics(CollectorRegistry())
    store = TieredStore(HostCache(LAYOUT, num_slots=2), [tier], metrics=metrics, retry_after=3600)
    try:
        assert list(store.list()) == []  # that listing failed: nothing from the tier
        assert store.tiers[0].up is True and store.tiers[0].writable is True
        assert store.get(chain[0].key) == chain[0].data  # disk-only chunks still hit
        assert metrics.registry.get_sample_value("chunkstore_tier_up", {"tier": "disk"}) == 1.0
    finally:
        store.close()
