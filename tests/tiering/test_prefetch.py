"""TieredStore.prefetch and lookup_prefix_async: background, per-key sources, never failing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.testing.store_suite import corrupt_copies
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT
from tests.tiering.doubles import (
    FlakyStore,
    StallingStore,
    assert_intact,
    cache_chunks,
    wait_until,
)


class FarStore(MemoryStore):
    """A memory store that says it is round-trip bound (takes the batched path)."""

    kind = "far"

    @property
    def high_latency(self) -> bool:
        return True


@pytest.fixture
def stores() -> Iterator[list[TieredStore]]:
    made: list[TieredStore] = []
    yield made
    for store in made:
        store.close()


def tiered(
    stores: list[TieredStore],
    metrics: ChunkstoreMetrics,
    tiers: list[MemoryStore | FsStore],
    host_slots: int = 8,
    **options: object,
) -> TieredStore:
    store = TieredStore(HostCache(LAYOUT, num_slots=host_slots), tiers, metrics=metrics, **options)  # type: ignore[arg-type]
    stores.append(store)
    return store


def keys(chain: list[MadeChunk]) -> list:
    return [c.key for c in chain]


def test_sources_per_key_and_stop_at_first_miss(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore], tmp_path: Path
) -> None:
    disk = FsStore(str(tmp_path / "kv"), create=True)
    far = FarStore(name="far")
    store = tiered(stores, metrics, [disk, far])
    store.host.insert(chain[0].key, chain[0].data)
    disk.put_many([(c.key, c.data) for c in (chain[1], chain[2], chain[4])])
    store.host.insert(chain[3].key, chain[3].data)
    far.put_many([(c.key, c.data) for c in (chain[5], chain[6])])
    # chain[7] is nowhere; chain[8] (in the disk tier) lies beyond the first miss.
    disk.put(chain[8].key, chain[8].data)

    sources = store.prefetch(keys(chain[:9])).result(timeout=30)
    assert sources == ["host", "fs", "fs", "host", "fs", "far", "far"]
    assert all(store.host.exists(c.key) for c in chain[:7])
    assert not store.host.exists(chain[8].key)
    assert store.host.get(chain[5].key) == chain[5].data
    assert store.stats().tiers[0].promotions == 3 and store.stats().tiers[1].promotions == 2
    assert store.stats().host.pinned_slots == 0
    # Everything is in host memory now.
    assert store.prefetch(keys(chain[:7])).result(timeout=30) == ["host"] * 7
    assert store.lookup_prefix_async(keys(chain[:9])).result(timeout=30) == 7


def test_failing_tier_gives_a_shorter_result_or_falls_back(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    flaky = FlakyStore("flaky")
    backup = MemoryStore(name="backup")
    store = tiered(stores, metrics, [flaky, backup], tier_timeout=None, retry_after=3600.0)
    flaky.put_many([(c.key, c.data) for c in chain[:4]])
    backup.put_many([(c.key, c.data) for c in chain[:2]])
    flaky.broken = True
    assert store.prefetch(keys(chain[:4])).result(timeout=30) == ["memory", "memory"]
    assert store.stats().tiers[0].errors == 1 and not store.stats().tiers[0].up
    backup.delete_many(keys(chain[:4]))
    store.host.delete_many(keys(chain[:4]))
    assert store.prefetch(keys(chain[:4])).result(timeout=30) == []
    assert store.lookup_prefix_async(keys(chain[:4])).result(timeout=30) == 0


def test_corrupt_chunk_ends_the_prefix(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    disk = MemoryStore(name="disk")
    store = tiered(stores, metrics, [disk])
    disk.put_many([(c.key, c.data) for c in chain[:3]])
    disk.put(chain[1].key, corrupt_copies(chain[1])["bitflip"])
    assert store.prefetch(keys(chain[:3])).result(timeout=30) == ["memory"]
    assert not store.host.exists(chain[1].key)
    assert disk.corrupt_detected == 1


def test_host_full_of_pinned_chunks_stops_the_prefetch(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    disk, far = MemoryStore(name="disk"), FarStore(name="far")
    store = tiered(stores, metrics, [disk], host_slots=2)
    disk.put_many([(c.key, c.data) for c in chain[:3]])
    store.host.insert(chain[5].key, chain[5].data)
    pinned = store.host.acquire(chain[5].key)
    assert store.prefetch(keys(chain[:3])).result(timeout=30) == ["memory"]
    pinned.release()  # type: ignore[union-attr]
    batched = tiered(stores, metrics, [far], host_slots=1)
    far.put_many([(c.key, c.data) for c in chain[:3]])
    batched.host.insert(chain[5].key, chain[5].data)
    held = batched.host.acquire(chain[5].key)
    assert batched.prefetch(keys(chain[:3])).result(timeout=30) == []
    held.release()  # type: ignore[union-attr]


def test_prefix_longer_than_host_memory_stops_where_it_is_full(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    for tier in (MemoryStore(name="disk"), FarStore(name="far")):
        tier.put_many([(c.key, c.data) for c in chain[:5]])
        store = tiered(stores, metrics, [tier], host_slots=3)
        sources = store.prefetch(keys(chain[:5])).result(timeout=30)
        assert sources == [tier.kind] * 3
        # What the result promises is in host memory (no chunk evicted an earlier one).
        assert [store.host.exists(c.key) for c in chain[:5]] == [True] * 3 + [False] * 2
        assert store.stats().host.pinned_slots == 0


def test_prefetch_does_not_block_the_caller(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    stalled = StallingStore("nfs")
    stalled.put_many([(c.key, c.data) for c in chain[:2]])
    store = tiered(stores, metrics, [stalled], tier_timeout=None)
    prefetch = store.prefetch(keys(chain[:2]))
    lookup = store.lookup_prefix_async(keys(chain[:2]))
    assert not prefetch.done() and not lookup.done()  # the tier holds them both
    stalled.release.set()
    assert prefetch.result(timeout=30) == ["memory", "memory"]
    assert lookup.result(timeout=30) == 2


@pytest.mark.parametrize("stall_lookups", [True, False], ids=["lookup", "read"])
def test_timed_out_tier_is_a_miss(
    chain: list[MadeChunk],
    metrics: ChunkstoreMetrics,
    stores: list[TieredStore],
    stall_lookups: bool,
) -> None:
    stalled = StallingStore("nfs", stall_lookups=stall_lookups)
    stalled.put(chain[0].key, chain[0].data)
    store = tiered(stores, metrics, [stalled], host_slots=2, tier_timeout=0.05, retry_after=3600.0)
    try:
        assert store.prefetch([chain[0].key]).result(timeout=30) == []
        assert store.stats().tiers[0].errors == 1
        # A read that timed out into a reserved slot still writes there once it ends.
        held = cache_chunks(store.host, chain[1:4])
        stalled.release.set()
        if not stall_lookups:
            assert stalled.finished.wait(timeout=30)
        wait_until(lambda: store.stats().host.pinned_slots == 0, "the stalled read's slot freed")
        assert_intact(store.host, held)
        assert not store.host.exists(chain[0].key)
        cache_chunks(store.host, chain[4:6])
    finally:
        stalled.release.set()


def test_closed_store_resolves_at_once(chain: list[MadeChunk], metrics: ChunkstoreMetrics) -> None:
    store = TieredStore(HostCache(LAYOUT, num_slots=2), [MemoryStore()], metrics=metrics)
    store.host.insert(chain[0].key, chain[0].data)
    assert store.prefetch([chain[0].key]).result(timeout=30) == ["host"]
    store.close()
    assert store.prefetch([chain[0].key]).result(timeout=0) == []
    assert store.lookup_prefix_async([chain[0].key]).result(timeout=0) == 0
