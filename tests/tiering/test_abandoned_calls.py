"""A tier call that times out keeps running: the memory it was given must stay out of use.

Each test lets a tier call time out, changes the memory that call still
holds a reference to (by reusing host slots or the caller's buffer), then
lets the stalled call finish and checks that neither host memory nor the
tier's copy was corrupted. The timeouts are short, but the stalled calls are
held by events, so every test takes the same path on a slow machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chunkstore.cache import HostCache
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT
from tests.tiering.doubles import (
    GatedStore,
    StallingStore,
    assert_intact,
    cache_chunks,
    wait_until,
)

TIMEOUT = 0.05
"""Tier timeout of these tests: the stalled calls always outlast it (they wait for an event)."""


@pytest.fixture
def stores() -> Iterator[list[TieredStore]]:
    made: list[TieredStore] = []
    yield made
    for store in made:
        store.close()


def test_timed_out_write_back_keeps_its_slot_until_the_write_ends(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    gated = GatedStore("disk")
    store = TieredStore(
        HostCache(LAYOUT, num_slots=2),
        [gated],
        tier_timeout=TIMEOUT,
        retry_after=3600.0,
        metrics=metrics,
        close_tiers=False,
    )
    stores.append(store)
    try:
        assert store.put(chain[0].key, chain[0].data)
        assert store.flush(timeout=30)  # the write timed out: dropped, but still running
        stuck = store.stats()
        # The stalled put reads chunk 0's slot when it resumes; nothing may be put there.
        held = cache_chunks(store.host, chain[1:4])
    finally:
        gated.gate.set()
    assert gated.finished.wait(timeout=30)
    wait_until(lambda: store.stats().host.pinned_slots == 0, "the written slot unpinned")
    # The late write stored chunk 0's own bytes (a verifying read would reject others).
    assert gated.get(chain[0].key) == chain[0].data
    assert gated.corrupt_detected == 0
    assert_intact(store.host, held)
    cache_chunks(store.host, chain[4:6])
    assert stuck.tiers[0].dropped == {"tier_error": 1}
    assert stuck.host.pinned_slots == 1 and stuck.tiers[0].abandoned == 1
    assert store.stats().tiers[0].abandoned == 0


def test_timed_out_write_through_reads_a_private_copy(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    gated = GatedStore("disk")
    # Slots smaller than a chunk: every put is written through to the tier from the caller.
    store = TieredStore(
        HostCache(1024, num_slots=2),
        [gated],
        tier_timeout=TIMEOUT,
        retry_after=3600.0,
        metrics=metrics,
        close_tiers=False,
    )
    stores.append(store)
    buffer = bytearray(chain[0].data)
    try:
        assert store.put(chain[0].key, buffer) is False  # timed out
        buffer[:] = chain[1].data  # the caller reuses its buffer at once
    finally:
        gated.gate.set()
    assert gated.finished.wait(timeout=30)
    assert gated.get(chain[0].key) == chain[0].data
    assert gated.corrupt_detected == 0


def test_read_around_host_memory_never_lends_the_callers_buffer(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    stalled = StallingStore("nfs", stall_lookups=False)
    stalled.put(chain[0].key, chain[0].data)
    store = TieredStore(
        HostCache(LAYOUT, num_slots=2),
        [stalled],
        tier_timeout=TIMEOUT,
        retry_after=3600.0,
        promote=False,
        metrics=metrics,
    )
    stores.append(store)
    buffer = bytearray(LAYOUT.total_size)
    try:
        assert store.get_into(chain[0].key, buffer) is None
        buffer[:] = chain[1].data  # the caller's next use of its buffer
    finally:
        stalled.release.set()
    assert stalled.finished.wait(timeout=30)  # the stalled read has returned its data
    assert bytes(buffer) == chain[1].data
    assert stalled.direct_reads == 0  # it was never given the caller's buffer


def test_inline_tier_calls_read_straight_into_the_callers_buffer(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics, stores: list[TieredStore]
) -> None:
    """Without a timeout nothing can outlive the call: the zero-copy path stays."""
    tier = StallingStore("nfs")
    tier.release.set()
    tier.put(chain[0].key, chain[0].data)
    store = TieredStore(
        HostCache(LAYOUT, num_slots=2), [tier], tier_timeout=None, promote=False, metrics=metrics
    )
    stores.append(store)
    buffer = bytearray(LAYOUT.total_size)
    assert store.get_into(chain[0].key, buffer) == len(chain[0].data)
    assert bytes(buffer) == chain[0].data
    assert tier.direct_reads == 1
