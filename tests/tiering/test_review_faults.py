"""Regression tests for defects a review of the host cache and tiered store found."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from chunkstore.backends._memory import MemoryStore
from chunkstore.backends.base import Buffer
from chunkstore.cache import HostCache, Lease
from chunkstore.errors import ConfigError
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk, sample_chunks
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT, SLOT
from tests.tiering.doubles import DirectStore, GatedStore, wait_until


def _metrics() -> ChunkstoreMetrics:
    return ChunkstoreMetrics(CollectorRegistry())


# --- two reservations of one key: the second commit keeps its pin ----------------------------


def _two_filled_reservations(
    store: HostCache | TieredStore, chunk: MadeChunk
) -> tuple[Lease, Lease]:
    """Two open reservations of ``chunk``'s key, each holding its bytes."""
    a = store.reserve(chunk.key)
    b = store.reserve(chunk.key)
    assert a is not None and b is not None
    for lease in (a, b):
        lease.view[: len(chunk.data)] = chunk.data
    return a, b


def test_second_commit_with_keep_pinned_returns_a_live_lease() -> None:
    k, other = sample_chunks(2, seed=3, layout=LAYOUT)
    host = HostCache(SLOT, num_slots=4)
    a, b = _two_filled_reservations(host, k)
    host.commit(b, len(k.data))
    host.commit(a, len(k.data), keep_pinned=True)
    assert not a.released and not a.writing
    host.put(other.key, other.data)  # the free list is LIFO: a freed slot would be reused here
    assert bytes(a.view) == k.data
    assert host.get(k.key) == k.data
    host.release(a)
    assert host.stats().pinned_slots == 0
    host.close()


def test_abort_after_the_other_reservation_committed_keeps_the_chunk() -> None:
    (k,) = sample_chunks(1, seed=5, layout=LAYOUT)
    host = HostCache(SLOT, num_slots=4)
    a, b = _two_filled_reservations(host, k)
    host.commit(b, len(k.data))
    host.abort(a)
    assert host.get(k.key) == k.data
    assert host.stats().pinned_slots == 0 and host.stats().chunks == 1
    host.close()


def test_tiered_write_back_of_the_second_commit_stores_the_right_bytes() -> None:
    k, other, first = sample_chunks(3, seed=4, layout=LAYOUT)
    tier = GatedStore("gated")
    ts = TieredStore(HostCache(SLOT, num_slots=4), [tier], write_batch=1, metrics=_metrics())
    try:
        ts.put(first.key, first.data)  # the drain thread blocks on this one
        wait_until(tier.entered.is_set, "drain busy")
        a, b = _two_filled_reservations(ts, k)
        ts.commit(b, len(k.data))
        ts.commit(a, len(k.data))
        ts.put(other.key, other.data)
        tier.gate.set()
        assert ts._writer.flush(10)
        assert tier.get(k.key) == k.data
    finally:
        tier.gate.set()
        ts.close()


class _FirstReaderWaits(DirectStore):
    """A tier whose first ``get_into`` waits for a gate (so two promotions overlap)."""

    def __init__(self) -> None:
        super().__init__(name="first-waits")
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls = 0

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.gate.wait(10)
        return super().get_into(key, buffer)


def test_concurrent_promotions_of_one_key_both_get_pinned_leases() -> None:
    k, other = sample_chunks(2, seed=8, layout=LAYOUT)
    tier = _FirstReaderWaits()
    tier.put(k.key, k.data)
    ts = TieredStore(HostCache(SLOT, num_slots=4), [tier], tier_timeout=None, metrics=_metrics())
    got: dict[str, object] = {}
    try:
        t = threading.Thread(target=lambda: got.setdefault("a", ts.acquire(k.key)))
        t.start()
        wait_until(tier.entered.is_set, "reader A inside the tier")
        b = ts.acquire(k.key)  # reader B promotes and commits first
        tier.gate.set()
        t.join(10)
        a = got["a"]
        assert a is not None and b is not None
        assert not a.released and not b.released  # type: ignore[attr-defined]
        ts.put(other.key, other.data)
        assert bytes(a.view[: len(k.data)]) == k.data  # type: ignore[attr-defined]
        ts.release(a)  # type: ignore[arg-type]
        ts.release(b)
        assert ts._writer.flush(10)
        assert ts.host.stats().pinned_slots == 0
    finally:
        tier.gate.set()
        ts.close()


# --- per-item write failures are dropped write-backs ------------------------------------------


class _RefusingStore(MemoryStore):
    """A tier whose plain put answers False per item, as S3Store does after its retries."""

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return [False] * len(items)


def test_items_a_tier_did_not_store_are_counted_as_dropped() -> None:
    (c,) = sample_chunks(1, seed=5, layout=LAYOUT)
    tier = _RefusingStore(name="refusing")
    ts = TieredStore(HostCache(SLOT, num_slots=4), [tier], metrics=_metrics())
    try:
        ts.put(c.key, c.data)
        assert ts._writer.flush(10)
        stats = ts.stats()
        assert not tier.exists(c.key)
        assert stats.tiers[0].dropped == {"tier_error": 1}
        assert stats.writes_dropped == 1
        assert ts.dropped_keys() == [c.key]
    finally:
        ts.close()


class _LosesEveryRace(MemoryStore):
    """A tier where another writer always stores the chunk first (put_if_absent says False)."""

    calls = 0

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self.calls += 1
        return [False] * len(items)


def test_put_if_absent_false_is_not_a_drop() -> None:
    c, other = sample_chunks(2, seed=6, layout=LAYOUT)
    tier = _LosesEveryRace(name="raced")
    ts = TieredStore(HostCache(SLOT, num_slots=1), [tier], metrics=_metrics())
    try:
        held = ts.reserve(other.key)  # host memory is full: the write goes straight to the tier
        assert held is not None
        assert not ts.put_if_absent(c.key, c.data)
        assert tier.calls == 1
        ts.abort(held)
        assert ts.stats().writes_dropped == 0 and ts.dropped_keys() == []
    finally:
        ts.close()


# --- a corrupt host chunk is a miss, not a hit -----------------------------------------------


@pytest.mark.parametrize("read", ["get_into", "get"])
def test_a_corrupt_host_read_counts_as_a_miss(read: str) -> None:
    (c,) = sample_chunks(1, seed=6, layout=LAYOUT)
    bad = bytearray(c.data)
    bad[-1] ^= 0xFF
    with HostCache(SLOT, num_slots=2, verify=True) as host:
        host.put(c.key, bytes(bad))
        got = host.get_into(c.key, bytearray(SLOT)) if read == "get_into" else host.get(c.key)
        assert got is None
        stats = host.stats()
        assert (stats.hits, stats.misses) == (0, 1)
        assert host.corrupt_detected == 1 and not host.exists(c.key)
        host.put(c.key, c.data)
        assert host.get(c.key) == c.data
        assert host.stats().hits == 1


# --- commit after close is a clear error ------------------------------------------------------


def test_host_commit_after_close_is_a_config_error() -> None:
    (c,) = sample_chunks(1, seed=9, layout=LAYOUT)
    host = HostCache(SLOT, num_slots=2)
    lease = host.reserve(c.key)
    assert lease is not None
    host.close()
    with pytest.raises(ConfigError, match="closed"):
        host.commit(lease, len(c.data))


def test_tiered_commit_after_close_is_a_config_error() -> None:
    (c,) = sample_chunks(1, seed=9, layout=LAYOUT)
    ts = TieredStore(HostCache(SLOT, num_slots=2), [], metrics=_metrics())
    lease = ts.reserve(c.key)
    assert lease is not None
    lease.view[: len(c.data)] = c.data
    ts.close()
    with pytest.raises(ConfigError, match="closed"):
        ts.commit(lease, len(c.data))


# --- a write around host memory waits for the undo of an older write-back ---------------------


class _UndoAfterRewrite(MemoryStore):
    """The first put (the write-back) waits for ``put_gate``; the second delete (the drain
    thread's undo of it) waits for ``undo_gate``, which a second put also opens: so a
    write-through that does not wait for the undo lands before it."""

    def __init__(self) -> None:
        super().__init__(name="slow")
        self.put_gate, self.put_entered = threading.Event(), threading.Event()
        self.undo_gate, self.undo_entered = threading.Event(), threading.Event()
        self.puts = self.deletes = 0

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self.puts += 1
        if self.puts == 1:
            self.put_entered.set()
            assert self.put_gate.wait(10)
        else:
            self.undo_gate.set()
        return super().put_many(items)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        self.deletes += 1
        if self.deletes == 2:
            self.undo_entered.set()
            assert self.undo_gate.wait(10)
        return super().delete_many(keys)


def test_a_put_after_delete_survives_the_undo_of_the_older_write_back() -> None:
    k, other = sample_chunks(2, seed=7, layout=LAYOUT)
    tier = _UndoAfterRewrite()
    ts = TieredStore(HostCache(SLOT, num_slots=1), [tier], tier_timeout=None, metrics=_metrics())
    try:
        ts.put(k.key, k.data)
        wait_until(tier.put_entered.is_set, "write-back under way")
        ts.delete(k.key)  # the write-back under way is to be undone
        tier.put_gate.set()
        wait_until(tier.undo_entered.is_set, "undo under way")
        busy = ts.reserve(other.key)  # the only slot is held: the next put goes around
        assert busy is not None
        # A put that waits for the undo (as it should) opens the undo's gate while waiting.
        queue = ts._writer._queue
        assert queue is not None
        waiting = queue._cond.wait

        def wait_and_let_the_undo_end(timeout: float | None = None) -> bool:
            tier.undo_gate.set()
            return waiting(timeout)

        queue._cond.wait = wait_and_let_the_undo_end  # type: ignore[method-assign]
        assert ts.put(k.key, k.data) is True
        ts.abort(busy)
        assert ts._writer.flush(10)
        assert tier.exists(k.key) and ts.exists(k.key)
        assert tier.deletes == 2
    finally:
        tier.put_gate.set()
        tier.undo_gate.set()
        ts.close()
