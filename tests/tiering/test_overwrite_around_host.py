"""A put that host memory cannot take while an older copy of the key waits for write-back."""

from __future__ import annotations

import threading

from chunkstore.cache import HostCache
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.testing.store_suite import _rekeyed
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT
from tests.tiering.doubles import GatedStore


def test_the_newer_copy_wins_over_a_write_back_under_way(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    tier = GatedStore("slow")
    store = TieredStore(HostCache(LAYOUT, num_slots=1), [tier], metrics=metrics, tier_timeout=None)
    try:
        old = chain[0]
        new = _rekeyed(old)
        assert store.put(old.key, old.data)  # host slot pinned, its write-back starts...
        assert tier.entered.wait(timeout=30)  # ...and hangs in the tier
        # Host memory has no free slot: the new copy must go around it, after the old write.
        opener = threading.Timer(0.05, tier.gate.set)
        opener.start()
        assert store.put(old.key, new)
        opener.join()
        assert store.flush(timeout=30)
        assert bytes(tier.get(old.key) or b"") == new
        assert bytes(store.get(old.key) or b"") == new
    finally:
        tier.gate.set()
        store.close()


def test_a_queued_older_copy_is_taken_back(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    tier = GatedStore("slow")
    store = TieredStore(HostCache(LAYOUT, num_slots=2), [tier], metrics=metrics, tier_timeout=None)
    try:
        first, old = chain[0], chain[1]
        new = _rekeyed(old)
        assert store.put(first.key, first.data)  # its write-back hangs in the tier
        assert tier.entered.wait(timeout=30)
        assert store.put(old.key, old.data)  # queued behind it; both slots now pinned
        opener = threading.Timer(0.05, tier.gate.set)
        opener.start()
        assert store.put(old.key, new)  # around host memory
        opener.join()
        assert store.flush(timeout=30)
        assert bytes(tier.get(old.key) or b"") == new  # the queued old copy never landed
        assert bytes(store.get(old.key) or b"") == new
        assert store.stats().host.pinned_slots == 0
    finally:
        tier.gate.set()
        store.close()
