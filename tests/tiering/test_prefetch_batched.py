"""Prefetch from tiers with batched zero-copy reads (get_many_into): slots filled together."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends.base import Buffer
from chunkstore.cache import HostCache
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.testing.store_suite import corrupt_copies
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT
from tests.tiering.doubles import StallingStore, assert_intact, cache_chunks, wait_until


class StallingBatchStore(StallingStore):
    """A stalled tier with batched reads: each ``get_many_into`` waits for ``release``."""

    def __init__(self, name: str) -> None:
        super().__init__(name, stall_lookups=False)
        self.batches: list[int] = []

    def get_many_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]
    ) -> list[int | None]:
        self.batches.append(len(keys))
        return [self.get_into(k, b) for k, b in zip(keys, buffers)]


@pytest.fixture
def made() -> Iterator[list[TieredStore]]:
    stores: list[TieredStore] = []
    yield stores
    for store in stores:
        store.close()


def test_a_batch_lands_in_host_slots_in_order(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, made: list[TieredStore], tmp_path: Path
) -> None:
    disk = FsStore(str(tmp_path / "kv"), create=True, io_workers=3)
    store = TieredStore(HostCache(LAYOUT, num_slots=8), [disk], metrics=metrics)
    made.append(store)
    disk.put_many([(c.key, c.data) for c in chain[:6]])
    assert store.prefetch([c.key for c in chain[:6]]).result(timeout=30) == ["fs"] * 6
    for chunk in chain[:6]:
        assert store.host.get(chunk.key) == chunk.data
    stats = store.stats()
    assert stats.tiers[0].promotions == 6 and stats.tiers[0].hits == 6
    assert stats.host.pinned_slots == 0


def test_a_corrupt_chunk_ends_the_prefix_and_frees_the_later_slots(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, made: list[TieredStore], tmp_path: Path
) -> None:
    disk = FsStore(str(tmp_path / "kv"), create=True)
    store = TieredStore(HostCache(LAYOUT, num_slots=8), [disk], metrics=metrics)
    made.append(store)
    disk.put_many([(c.key, c.data) for c in chain[:5]])
    disk.put(chain[2].key, corrupt_copies(chain[2])["bitflip"])
    assert store.prefetch([c.key for c in chain[:5]]).result(timeout=30) == ["fs", "fs"]
    assert [store.host.exists(c.key) for c in chain[:5]] == [True, True, False, False, False]
    assert disk.corrupt_detected == 1
    assert store.stats().host.pinned_slots == 0
    assert store.stats().host.chunks == 2  # the slots reserved past the corrupt one are free


def test_a_timed_out_batch_keeps_its_slots_until_the_call_ends(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, made: list[TieredStore]
) -> None:
    stalled = StallingBatchStore("nfs")
    stalled.put_many([(c.key, c.data) for c in chain[:2]])
    store = TieredStore(
        HostCache(LAYOUT, num_slots=4),
        [stalled],
        metrics=metrics,
        tier_timeout=0.05,
        retry_after=3600.0,
    )
    made.append(store)
    try:
        assert store.prefetch([c.key for c in chain[:2]]).result(timeout=30) == []
        assert stalled.batches == [2]
        assert store.stats().host.pinned_slots == 2  # the stalled call may still write there
        held = cache_chunks(store.host, chain[2:4])
        stalled.release.set()
        wait_until(lambda: store.stats().host.pinned_slots == 0, "the stalled batch's slots freed")
        assert_intact(store.host, held)
        assert not any(store.host.exists(c.key) for c in chain[:2])
    finally:
        stalled.release.set()
