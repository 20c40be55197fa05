"""Deleting chunks whose write-back is queued or under way: no waiting, no resurrection.

The tier's writes are held by a gate that only the test opens, so a delete
that waited for the write-behind queue would never return on its own; each
delete runs on a helper thread and the test checks it finished while the
gate was still shut.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from chunkstore.cache import HostCache
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT
from tests.tiering.doubles import GatedStore


def _returns_while_gated(call: Callable[[], Any], gated: GatedStore) -> Any:
    """``call()``'s result; fails if it only returned because the gate was opened."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(timeout=10)  # a guard against a hang, not a speed requirement
    assert not worker.is_alive(), "the call waited for the stalled write-back"
    assert not gated.gate.is_set()
    return result[0]


def _store(gated: GatedStore, metrics: ChunkstoreMetrics, **options: Any) -> TieredStore:
    return TieredStore(
        HostCache(LAYOUT, num_slots=4),
        [gated],
        tier_timeout=None,
        metrics=metrics,
        close_tiers=False,
        write_batch=1,
        **options,
    )


def test_delete_withdraws_queued_write_backs_without_waiting(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    gated = GatedStore("disk")
    store = _store(gated, metrics)
    try:
        store.put(chain[0].key, chain[0].data)
        assert gated.entered.wait(timeout=30)  # chunk 0 is being written, and stalls
        store.put_many([(c.key, c.data) for c in chain[1:3]])  # queued behind it
        assert _returns_while_gated(lambda: store.delete(chain[1].key), gated) is True
        assert store.stats().queue_depth == 2  # chunk 0 (writing) and chunk 2
        assert store.stats().host.pinned_slots == 2  # chunk 1's write-back pin is gone
        assert store.get(chain[1].key) is None
    finally:
        gated.gate.set()
    assert store.flush(timeout=30)
    assert gated.exists_many([c.key for c in chain[:3]]) == [True, False, True]
    assert store.get(chain[1].key) is None
    assert store.stats().tiers[0].dropped == {}  # withdrawn, not dropped
    store.close()


def test_delete_during_the_write_is_undone_when_it_ends(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    gated = GatedStore("disk")
    store = _store(gated, metrics)
    try:
        store.put(chain[0].key, chain[0].data)
        assert gated.entered.wait(timeout=30)
        assert _returns_while_gated(lambda: store.delete(chain[0].key), gated) is True
    finally:
        gated.gate.set()
    assert store.flush(timeout=30)  # the write lands, then is deleted again
    assert not gated.exists(chain[0].key)
    assert store.get(chain[0].key) is None
    # A later put of the same key is written as usual.
    store.put(chain[0].key, chain[0].data)
    assert store.flush(timeout=30)
    assert gated.get(chain[0].key) == chain[0].data
    store.close()


def test_corrupt_host_chunk_is_quarantined_without_waiting_for_the_queue(
    chain: list[MadeChunk], metrics: ChunkstoreMetrics
) -> None:
    gated = GatedStore("disk")
    store = _store(gated, metrics, verify=True)
    try:
        store.put(chain[0].key, chain[0].data)
        assert gated.entered.wait(timeout=30)
        store.host.put(chain[1].key, chain[1].data)
        lease = store.host.acquire(chain[1].key)
        assert lease is not None
        store.host.pool.view(lease.slot)[len(chain[1].data) - 1] ^= 0xFF  # bit rot
        store.host.release(lease)
        assert _returns_while_gated(lambda: store.get(chain[1].key), gated) is None
        assert store.corrupt_detected == 1
        assert not store.host.exists(chain[1].key)
    finally:
        gated.gate.set()
    assert store.flush(timeout=30)
    store.close()
