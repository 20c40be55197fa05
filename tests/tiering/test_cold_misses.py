"""A read of a chunk that no tier has must not cost host memory a resident chunk.

``get_into`` and ``acquire`` promote into a host slot; the slot is made room
for only once a tier has shown it holds the chunk. On a full host cache a
burst of cold misses (the common case for new prompts) therefore evicts
nothing, for both policies and every kind of tier read path.
"""

from __future__ import annotations

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT
from tests.tiering.doubles import DirectStore, FarDirectStore

TIERS = {
    "direct": lambda: DirectStore("disk"),  # zero-copy get_into, low latency: exists first
    "far": lambda: FarDirectStore("far"),  # round-trip bound: read privately, then insert
    "plain": lambda: MemoryStore(name="mem"),  # no get_into: read privately, then insert
}


def _read(store: TieredStore, path: str, chunk: MadeChunk) -> bytes | None:
    if path == "get_into":
        buffer = bytearray(LAYOUT.total_size)
        size = store.get_into(chunk.key, buffer)
        return None if size is None else bytes(buffer[:size])
    lease = store.acquire(chunk.key)
    if lease is None:
        return None
    with lease:
        return bytes(lease.view)


@pytest.mark.parametrize("policy", ["arc", "lru"])
@pytest.mark.parametrize("tier_kind", sorted(TIERS))
@pytest.mark.parametrize("path", ["get_into", "acquire"])
def test_cold_misses_evict_nothing(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, policy: str, tier_kind: str, path: str
) -> None:
    tier = TIERS[tier_kind]()
    host = HostCache(LAYOUT, num_slots=2, policy=policy)
    with TieredStore(host, [tier], tier_timeout=None, metrics=metrics) as store:
        # Host-only chunks (as after a dropped write-back): eviction would lose them.
        host.put_many([(c.key, c.data) for c in chain[:2]])
        for chunk in chain[2:6]:
            assert _read(store, path, chunk) is None
        assert host.stats().evictions == 0
        assert host.exists_many([c.key for c in chain[:2]]) == [True, True]
        assert store.stats().tiers[0].misses == 4
        # A chunk the tier does have is still promoted, making room as usual.
        tier.put(chain[6].key, chain[6].data)
        assert _read(store, path, chain[6]) == chain[6].data
        assert host.stats().evictions == 1 and host.exists(chain[6].key)
        assert store.stats().tiers[0].promotions == 1
        assert host.stats().pinned_slots == 0


@pytest.mark.parametrize("policy", ["arc", "lru"])
def test_misses_into_free_slots_leave_no_trace(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, policy: str
) -> None:
    host = HostCache(LAYOUT, num_slots=3, policy=policy)
    tier = DirectStore("disk")
    with TieredStore(host, [tier], tier_timeout=None, metrics=metrics) as store:
        host.put_many([(c.key, c.data) for c in chain[:2]])
        assert store.get_into(chain[5].key, bytearray(LAYOUT.total_size)) is None
        assert tier.direct_reads == 1  # asked straight into the free slot
        stats = host.stats()
        assert (stats.evictions, stats.rejected, stats.chunks, stats.pinned_slots) == (0, 0, 2, 0)
        # The slot came back: both a later promotion and the residents fit without eviction.
        tier.put(chain[6].key, chain[6].data)
        assert store.get(chain[6].key) == chain[6].data
        assert host.exists_many([c.key for c in (chain[0], chain[1], chain[6])]) == [True] * 3
        assert host.stats().evictions == 0
