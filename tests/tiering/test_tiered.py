"""TieredStore: the store contract, write-behind, promotion, tier failures, flushing."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.errors import ConfigError
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.testing.stateful import store_state_machine
from chunkstore.testing.store_suite import StoreSuite
from chunkstore.tiering import TieredStore
from chunkstore.tiering._guard import TierUnavailable
from tests.cache.conftest import LAYOUT, SLOT
from tests.tiering.doubles import (
    FlakyStore,
    GatedStore,
    StallingSetAside,
    StallingStore,
    VerifyTurnedOnDuringRead,
    assert_intact,
    cache_chunks,
    wait_until,
)


def _tiered(host_slots: int, tiers: int = 1, **options: object) -> TieredStore:
    stores = [MemoryStore(name=f"tier{i}") for i in range(tiers)]
    return TieredStore(
        HostCache(SLOT, num_slots=host_slots),
        stores,
        verify=True,
        metrics=ChunkstoreMetrics(CollectorRegistry()),
        **options,  # type: ignore[arg-type]
    )


class TestTieredStore(StoreSuite):
    persistent = False

    @pytest.fixture
    def make_store(self) -> Callable[[], TieredStore]:
        return lambda: _tiered(32)


class TestTieredStoreSmallHost(StoreSuite):
    """Host memory smaller than the suite's chunks: reads come from the tiers and promote."""

    persistent = False

    @pytest.fixture
    def make_store(self) -> Callable[[], TieredStore]:
        return lambda: _tiered(4, tiers=2, write_tiers="first")


class _SettledTiered(TieredStore):
    """A tiered store whose writes have reached its tiers when they return: the state
    machine's model (and its count of corrupt copies found) then does not depend on when
    the write-behind thread runs. Write-behind itself is tested above and below."""

    def put(self, key, data):  # type: ignore[no-untyped-def]
        written = super().put(key, data)
        assert self.flush(timeout=30)
        return written

    def put_if_absent(self, key, data):  # type: ignore[no-untyped-def]
        written = super().put_if_absent(key, data)
        assert self.flush(timeout=30)
        return written

    def delete(self, key):  # type: ignore[no-untyped-def]
        deleted = super().delete(key)
        assert self.flush(timeout=30)
        return deleted


def _settled_tiered() -> TieredStore:
    stores = [MemoryStore(name=f"tier{i}") for i in range(2)]
    return _SettledTiered(
        HostCache(SLOT, num_slots=3),
        stores,
        verify=True,
        metrics=ChunkstoreMetrics(CollectorRegistry()),
    )


TestTieredMachine = store_state_machine(_settled_tiered, max_examples=20, copies=3).TestCase


@pytest.fixture
def disk() -> MemoryStore:
    return MemoryStore(name="disk")


@pytest.fixture
def registry_metrics() -> ChunkstoreMetrics:
    return ChunkstoreMetrics(CollectorRegistry())


def make(
    host_slots: int, tiers: list[MemoryStore], metrics: ChunkstoreMetrics, **options: object
) -> TieredStore:
    return TieredStore(HostCache(LAYOUT, num_slots=host_slots), tiers, metrics=metrics, **options)  # type: ignore[arg-type]


def test_rejects_bad_options(disk: MemoryStore, registry_metrics: ChunkstoreMetrics) -> None:
    host = HostCache(LAYOUT, num_slots=2)
    with pytest.raises(ConfigError, match="write_tiers"):
        TieredStore(host, [disk], write_tiers="some", metrics=registry_metrics)
    with pytest.raises(ConfigError, match="unique"):
        TieredStore(host, [disk, MemoryStore(name="disk")], metrics=registry_metrics)
    with pytest.raises(ConfigError, match="tier_timeout"):
        TieredStore(host, [disk], tier_timeout=0, metrics=registry_metrics)
    host.close()


def test_write_behind_reaches_every_tier(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    first, second = MemoryStore(name="fast"), MemoryStore(name="slow")
    with make(4, [first, second], registry_metrics, tier_timeout=None) as store:
        assert store.put_many([(c.key, c.data) for c in chain[:6]]) == [True] * 6
        assert store.flush(timeout=30)
        for tier in (first, second):
            assert tier.exists_many([c.key for c in chain[:6]]) == [True] * 6
        assert [t.writes for t in store.stats().tiers] == [6, 6]


def test_write_to_first_tier_only(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    first, second = MemoryStore(name="fast"), MemoryStore(name="slow")
    with make(4, [first, second], registry_metrics, write_tiers="first") as store:
        store.put_many([(c.key, c.data) for c in chain[:3]])
        store.flush()
        assert first.exists_many([c.key for c in chain[:3]]) == [True] * 3
        assert second.exists_many([c.key for c in chain[:3]]) == [False] * 3


def test_full_queue_drops_and_reports(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    gated = GatedStore("disk")
    store = make(10, [gated], registry_metrics, queue_size=2, write_batch=1)
    try:
        assert store.put(chain[0].key, chain[0].data)
        assert gated.entered.wait(timeout=30)  # chunk 0 is being written; the queue is empty
        # The caller is never blocked: chunks 1 and 2 wait in the queue, 3..5 are dropped.
        assert store.put_many([(c.key, c.data) for c in chain[1:6]]) == [True] * 5
        stats = store.stats()
        assert stats.writes_dropped == 3
        assert stats.tiers[0].dropped == {"queue_full": 3}
        assert store.dropped_keys() == [c.key for c in chain[3:6]]
        assert store.health().queue_depth == 2
        gated.gate.set()
        assert store.flush(timeout=30)
        assert gated.exists_many([c.key for c in chain[:6]]) == [True] * 3 + [False] * 3
        # Dropped chunks were still cached: readers get them from host memory.
        assert store.get(chain[4].key) == chain[4].data
        value = registry_metrics.registry.get_sample_value(
            "chunkstore_writes_dropped_total", {"tier": "disk", "reason": "queue_full"}
        )
        assert value == 3
    finally:
        gated.gate.set()
        store.close()


def test_unpersisted_chunks_survive_eviction_pressure(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    gated, archive = GatedStore("disk"), MemoryStore(name="archive")
    archive.put_many([(c.key, c.data) for c in chain[6:12]])
    # ARC: the promotions below evict exactly the three older chunks (parc would first evict
    # the promoted run itself, whose parent chain[5] is not cached).
    host = HostCache(LAYOUT, num_slots=3, policy="arc")
    store = TieredStore(
        host, [gated, archive], metrics=registry_metrics, write_tiers="first", queue_size=8
    )
    try:
        store.put_many([(c.key, c.data) for c in chain[:3]])  # fills host; none persisted yet
        buffer = bytearray(LAYOUT.total_size)
        for made in chain[6:12]:
            # Host memory is all pinned by pending write-backs: reads go around it.
            assert store.get_into(made.key, buffer) == len(made.data)
            assert bytes(buffer) == made.data
            assert store.get(made.key) == made.data
        assert store.host.exists_many([c.key for c in chain[:3]]) == [True] * 3
        assert store.stats().tiers[1].promotions == 0
        gated.gate.set()
        assert store.flush(timeout=30)
        assert gated.exists_many([c.key for c in chain[:3]]) == [True] * 3
        # Persisted, the chunks may now make room for promotions.
        for made in chain[6:9]:
            assert store.get(made.key) == made.data
        assert store.stats().tiers[1].promotions == 3
        assert store.host.exists_many([c.key for c in chain[:3]]) == [False] * 3
        assert [store.get(c.key) for c in chain[:3]] == [c.data for c in chain[:3]]
    finally:
        gated.gate.set()
        store.close()


def test_close_flushes_pending_writes(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    gated = GatedStore("disk")
    store = make(12, [gated], registry_metrics, close_tiers=False, write_batch=2)
    store.put_many([(c.key, c.data) for c in chain])
    gated.gate.set()
    store.close()
    assert gated.exists_many([c.key for c in chain]) == [True] * len(chain)
    with pytest.raises(ConfigError, match="closed"):
        store.put(chain[0].key, chain[0].data)


def test_promotion_on_secondary_hit(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    disk = MemoryStore(name="disk")
    disk.put_many([(c.key, c.data) for c in chain[:4]])
    with make(2, [disk], registry_metrics) as store:
        assert store.get(chain[0].key) == chain[0].data
        assert store.host.exists(chain[0].key)
        buffer = np.zeros(LAYOUT.total_size, dtype=np.uint8)
        assert store.get_into(chain[1].key, buffer) == LAYOUT.total_size
        assert buffer.tobytes() == chain[1].data
        with store.acquire(chain[2].key) as lease:  # type: ignore[union-attr]
            assert bytes(lease.view) == chain[2].data
        assert store.get(chain[2].key) == chain[2].data  # now a host hit
        stats = store.stats()
        assert (stats.tiers[0].hits, stats.tiers[0].promotions) == (3, 3)
        assert stats.host.hits == 1 and stats.host.pinned_slots == 0
        assert store.get(chain[9].key) is None
        assert store.stats().tiers[0].misses == 1


def test_no_promotion_reads_around_host(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    disk = MemoryStore(name="disk")
    disk.put(chain[0].key, chain[0].data)
    with make(2, [disk], registry_metrics, promote=False) as store:
        buffer = bytearray(LAYOUT.total_size)
        assert store.get_into(chain[0].key, buffer) == len(chain[0].data)
        assert store.get(chain[0].key) == chain[0].data
        assert store.acquire(chain[0].key) is None
        assert not store.host.exists(chain[0].key)


def test_lookup_prefix_across_tiers(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    disk, archive = MemoryStore(name="disk"), MemoryStore(name="archive")
    keys = [c.key for c in chain]
    disk.put_many([(c.key, c.data) for i, c in enumerate(chain[:8]) if i != 3])
    archive.put_many([(chain[3].key, chain[3].data), (chain[8].key, chain[8].data)])
    with make(4, [disk, archive], registry_metrics) as store:
        store.host.put_many([(c.key, c.data) for c in chain[:2]])
        # host 0-1, disk 2, archive 3, disk 4-7, archive 8, nobody 9.
        assert store.lookup_prefix(keys) == 9
        assert store.lookup_prefix(keys[:5]) == 5
        assert store.lookup_prefix([keys[9], *keys]) == 0
        assert store.exists_many([keys[3], keys[9]]) == [True, False]


def test_failing_tier_degrades_and_is_retried(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    now = [1000.0]
    flaky = FlakyStore("disk")
    flaky.put_many([(c.key, c.data) for c in chain[:4]])
    store = make(2, [flaky], registry_metrics, retry_after=60.0, clock=lambda: now[0])
    try:
        flaky.broken = True
        assert store.get(chain[0].key) is None  # the outage is a miss, not an exception
        assert store.stats().tiers[0].up is False
        calls = flaky.calls
        assert store.exists(chain[1].key) is False
        assert store.lookup_prefix([c.key for c in chain[:4]]) == 0
        assert store.put(chain[5].key, chain[5].data) is True  # cached; write-back dropped
        assert store.flush(timeout=30)
        assert flaky.calls == calls  # in back-off: not even asked
        stats = store.stats().tiers[0]
        assert stats.dropped == {"tier_down": 1} and stats.errors == 1
        assert store.get(chain[5].key) == chain[5].data
        flaky.broken = False
        now[0] += 61.0  # back-off over: the next call tries the tier again
        assert store.get(chain[0].key) == chain[0].data
        assert store.stats().tiers[0].up is True
        flaky.broken = True
        store.put(chain[6].key, chain[6].data)
        assert store.flush(timeout=30)
        assert store.stats().tiers[0].dropped == {"tier_down": 1, "tier_error": 1}
        errors = registry_metrics.registry.get_sample_value(
            "chunkstore_tier_errors_total", {"tier": "disk", "op": "put"}
        )
        assert errors == 1
    finally:
        store.close()


@pytest.mark.parametrize("path", ["get", "get_into", "acquire"])
def test_stalled_tier_times_out_to_a_miss(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics, path: str
) -> None:
    stalled = StallingStore("nfs")
    stalled.put(chain[0].key, chain[0].data)
    store = make(2, [stalled], registry_metrics, tier_timeout=0.05, retry_after=3600.0)
    try:
        if path == "get":
            assert store.get(chain[0].key) is None
        elif path == "get_into":
            assert store.get_into(chain[0].key, bytearray(LAYOUT.total_size)) is None
        else:
            assert store.acquire(chain[0].key) is None
        assert store.exists(chain[0].key) is False  # in back-off: answered at once
        assert store.stats().tiers[0].errors == 1
        up = registry_metrics.registry.get_sample_value("chunkstore_tier_up", {"tier": "nfs"})
        assert up == 0.0
        # The abandoned read cannot be stopped: it writes chunk 0 wherever it was told to
        # once released. Chunks cached meanwhile must not be in that memory.
        held = cache_chunks(store.host, chain[1:4])
        stalled.release.set()
        assert stalled.finished.wait(timeout=30)
        wait_until(lambda: store.stats().host.pinned_slots == 0, "the stalled read's slot freed")
        assert_intact(store.host, held)
        assert not store.host.exists(chain[0].key)
        cache_chunks(store.host, chain[4:6])  # the slot it held is in use again
        assert store.stats().tiers[0].abandoned == 0
    finally:
        stalled.release.set()
        store.close()


def test_reserve_commit_queues_write_back(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    disk = MemoryStore(name="disk")
    with make(2, [disk], registry_metrics) as store:
        lease = store.reserve(chain[0].key)
        assert lease is not None
        lease.view[: len(chain[0].data)] = chain[0].data
        store.commit(lease, len(chain[0].data))
        aborted = store.reserve(chain[1].key)
        store.abort(aborted)  # type: ignore[arg-type]
        assert store.flush(timeout=30)
        assert disk.get(chain[0].key) == chain[0].data
        assert not disk.exists(chain[1].key)
        assert store.stats().host.pinned_slots == 0


def test_delete_reaches_pending_and_persisted_copies(
    chain: list[MadeChunk], registry_metrics: ChunkstoreMetrics
) -> None:
    gated = GatedStore("disk")
    store = make(4, [gated], registry_metrics)
    try:
        store.put(chain[0].key, chain[0].data)
        gated.gate.set()
        assert store.delete(chain[0].key) is True
        assert store.get(chain[0].key) is None and not gated.exists(chain[0].key)
    finally:
        store.close()


@pytest.fixture
def closed_stores() -> Iterator[list[TieredStore]]:
    stores: list[TieredStore] = []
    yield stores
    for store in stores:
        store.close()


def test_oversized_chunk_is_written_through(
    chain: list[MadeChunk], closed_stores: list[TieredStore], registry_metrics: ChunkstoreMetrics
) -> None:
    disk = MemoryStore(name="disk")
    store = TieredStore(HostCache(1024, num_slots=2), [disk], metrics=registry_metrics)
    closed_stores.append(store)
    assert store.put(chain[0].key, chain[0].data) is True
    assert disk.get(chain[0].key) == chain[0].data
    assert store.get(chain[0].key) == chain[0].data


def test_lookup_prefix_alternates_between_host_and_tiers() -> None:
    """Chunk 0 only in the tier, chunk 1 only in host memory, chunk 2 only in the tier."""
    from chunkstore.testing.factories import sample_chunks

    store = _tiered(4, tiers=1, write_tiers="first")
    try:
        chunks = sample_chunks(3, layout=LAYOUT)
        tier = store.tiers[0].store
        tier.put_many([(chunks[0].key, chunks[0].data), (chunks[2].key, chunks[2].data)])
        store.host.insert(chunks[1].key, chunks[1].data)
        assert store.lookup_prefix([c.key for c in chunks]) == 3
    finally:
        store.close()


@pytest.mark.parametrize("path", ["acquire", "prefetch", "get"])
def test_compressed_tier_chunks_are_uncompressed_in_host_memory(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host slots are read through the layout's views, so they hold no zstd payloads (but
    for chunks with a MAC: below). The tier verified the compressed chunk: decompressing it
    does not hash it again."""
    from chunkstore.format import _chunk, decode_chunk, read_header, recompress
    from chunkstore.testing.factories import sample_chunks

    store = _tiered(4, tiers=1)
    try:
        chunk = sample_chunks(1, layout=LAYOUT)[0]
        packed = recompress(chunk.data, "zstd")
        assert len(packed) < len(chunk.data)
        store.tiers[0].store.put(chunk.key, packed)
        stored = packed[read_header(packed).data_offset :]
        hashed: list[bytes] = []
        real = _chunk._checksum
        monkeypatch.setattr(
            _chunk, "_checksum", lambda head, data: hashed.append(bytes(data)) or real(head, data)
        )
        if path == "acquire":
            lease = store.acquire(chunk.key)
            assert lease is not None
            store.release(lease)
        elif path == "prefetch":
            assert store.prefetch([chunk.key]).result(timeout=30) == ["memory"]
        else:
            got = store.get(chunk.key)
        assert hashed.count(stored) == 1  # by the tier's own check
        if path == "get":
            assert decode_chunk(got).header.key == chunk.key.digest
        held = store.host.acquire(chunk.key)
        assert held is not None
        try:
            assert bytes(held.view[: len(chunk.data)]) == chunk.data
            assert decode_chunk(held.view[: len(chunk.data)]).header.compression == "none"
        finally:
            store.host.release(held)
    finally:
        store.close()


@pytest.mark.parametrize("tier_verifies", [True, False])
def test_verify_checks_each_chunk_once(
    monkeypatch: pytest.MonkeyPatch, tier_verifies: bool
) -> None:
    """``verify`` checks what host memory serves, once; a chunk from a tier is checked by
    the tier, or here where the tier does not check its own (damage there is still a miss)."""
    from chunkstore.backends import base
    from chunkstore.testing.factories import sample_chunks
    from chunkstore.testing.store_suite import corrupt_copies

    tier = MemoryStore(name="tier0", verify=tier_verifies)
    store = TieredStore(HostCache(SLOT, num_slots=4), [tier], verify=True, promote=False)
    try:
        held, cold, bad = sample_chunks(3, layout=LAYOUT)
        store.host.insert(held.key, held.data)
        tier.put(cold.key, cold.data)
        tier.put(bad.key, corrupt_copies(bad)["bitflip"])
        judged: list[bytes] = []
        real = base.judge
        monkeypatch.setattr(
            base, "judge", lambda key, data: judged.append(key.digest) or real(key, data)
        )
        assert store.get_many([held.key, cold.key, bad.key]) == [held.data, cold.data, None]
        assert sorted(judged) == sorted([held.key.digest, cold.key.digest, bad.key.digest])
    finally:
        store.close()


READ_PATHS = ["get", "get_into", "acquire", "prefetch"]
"""The tiered store's read paths (``get_into`` with promotion off: it reads around host
memory; any other name than these reads by ``get_into`` with promotion on)."""


def _verifying_over(tiers: list[Any], path: str) -> TieredStore:
    """A tiered store with ``verify`` over ``tiers``, set up for read path ``path``."""
    return TieredStore(
        HostCache(SLOT, num_slots=4),
        tiers,
        verify=True,
        promote=path != "get_into",
        metrics=ChunkstoreMetrics(CollectorRegistry()),
    )


def _read_by(store: TieredStore, path: str, key: ChunkKey) -> bytes | None:
    """``key``'s chunk as read path ``path`` serves it (a prefetch: as host memory holds it
    afterwards), or ``None``."""
    if path == "get":
        return store.get(key)
    if path == "acquire":
        lease = store.acquire(key)
        if lease is None:
            return None
        with lease:
            return bytes(lease.view)
    if path == "prefetch":
        if not store.prefetch([key]).result(timeout=30):
            return None
        lease = store.host.acquire(key)
        assert lease is not None
        with lease:
            return bytes(lease.view)
    buffer = bytearray(SLOT)
    size = store.get_into(key, buffer)
    return None if size is None else bytes(buffer[:size])


def _unverified_tier(kind: str, tmp_path: object) -> Any:
    from chunkstore.backends._fs import FsStore

    if kind == "memory":
        return MemoryStore(name="tier0", verify=False)
    return FsStore(str(tmp_path), create=True, verify=False)


@pytest.mark.parametrize("tier_kind", ["memory", "fs"])
@pytest.mark.parametrize("path", ["get_into", "get_into promoted", "acquire", "prefetch"])
def test_verify_checks_a_non_verifying_tier_on_every_read_path(
    tier_kind: str, path: str, tmp_path: object
) -> None:
    """With ``verify``, a chunk from a tier that does not check its own reads is checked
    here on every path, not only ``get_many``: a flipped bit is a counted miss (set aside),
    never bytes in the caller's buffer or in host memory; a good chunk is served exactly."""
    from chunkstore.testing.factories import sample_chunks
    from chunkstore.testing.store_suite import corrupt_copies

    tier = _unverified_tier(tier_kind, tmp_path)
    store = _verifying_over([tier], path)
    try:
        good, bad = sample_chunks(2, layout=LAYOUT)
        tier.put(good.key, good.data)
        tier.put(bad.key, corrupt_copies(bad)["bitflip"])
        assert _read_by(store, path, good.key) == good.data
        assert _read_by(store, path, bad.key) is None
        assert store.corrupt_detected == 1
        assert store.host.acquire(bad.key) is None  # nothing corrupt reached host memory
        wait_until(lambda: not tier.exists(bad.key), "set aside (by the tier's guard)")
        assert _read_by(store, path, bad.key) is None  # and a plain miss afterwards
        assert store.corrupt_detected == 1
    finally:
        store.close()


def _damaged_above_intact(
    fast: MemoryStore, path: str
) -> tuple[TieredStore, MemoryStore, MadeChunk]:
    """A verifying tiered store for read path ``path`` over ``fast`` (opened without
    ``verify``), holding a chunk with a flipped bit, and a verifying ``cold`` tier below it
    holding that chunk intact: (store, cold, chunk)."""
    from chunkstore.testing.factories import sample_chunks
    from chunkstore.testing.store_suite import corrupt_copies

    cold = MemoryStore(name="cold", verify=True)
    store = _verifying_over([fast, cold], path)
    (chunk,) = sample_chunks(1, layout=LAYOUT)
    fast.put(chunk.key, corrupt_copies(chunk)["bitflip"])
    cold.put(chunk.key, chunk.data)
    return store, cold, chunk


@pytest.mark.parametrize("path", READ_PATHS)
def test_damage_in_a_non_verifying_tier_leaves_a_lower_tiers_copy(path: str) -> None:
    """A corrupt chunk that ``verify`` finds in a tier that does not check its own reads is
    that tier's damage: it is counted once and set aside there, and the intact copy a lower
    tier holds is kept and served (the check used to delete the key from every tier)."""
    fast = MemoryStore(name="fast", verify=False)
    store, cold, chunk = _damaged_above_intact(fast, path)
    try:
        assert _read_by(store, path, chunk.key) == chunk.data
        assert cold.get(chunk.key) == chunk.data  # the intact copy is kept
        wait_until(lambda: not fast.exists(chunk.key), "the damaged one set aside")
        assert (store.corrupt_detected, fast.corrupt_detected) == (1, 1)
        assert _read_by(store, path, chunk.key) == chunk.data  # and served from below next
    finally:
        store.close()


@pytest.mark.parametrize("path", READ_PATHS)
def test_a_tier_stalling_in_its_set_aside_does_not_stall_the_read(path: str) -> None:
    """Setting aside the damaged copy that ``verify`` found in a tier that does not check
    its own reads is that tier's call, made through its guard and not waited for: a tier
    stalling in it (a hung mount's rename) used to stall the read on the reading thread.
    The read serves the lower tier's copy at once; the damage is counted at once, and the
    copy is set aside once the tier goes on."""
    fast = StallingSetAside("fast")
    store, cold, chunk = _damaged_above_intact(fast, path)
    try:
        assert _read_by(store, path, chunk.key) == chunk.data
        fast.events.append("read returned")
        assert (store.corrupt_detected, fast.corrupt_detected) == (1, 1)
        assert fast.began.wait(timeout=30)  # the set-aside waits in the tier...
        assert fast.exists(chunk.key)
        fast.release.set()  # ...and goes on once the tier does
        wait_until(lambda: not fast.exists(chunk.key), "the damaged copy set aside")
        assert fast.events == ["read returned", "set aside"]
        assert cold.get(chunk.key) == chunk.data
    finally:
        fast.release.set()
        store.close()


def test_a_tier_in_back_off_is_not_asked_to_set_aside(caplog: pytest.LogCaptureFixture) -> None:
    """A tier whose writes are in back-off (it said it is full) is not called to set aside
    the damaged copy a read found there: the read is still served from below, the damage
    counted, and the warning says the copy was not set aside."""
    fast = StallingSetAside("fast")
    fast.release.set()
    store, _, chunk = _damaged_above_intact(fast, "get")
    try:

        def full() -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        with pytest.raises(TierUnavailable):
            store.tiers[0].call("put", full)
        assert store.tiers[0].up and not store.tiers[0].writable
        with caplog.at_level(logging.WARNING):
            assert store.get(chunk.key) == chunk.data
        assert fast.corrupt_detected == 1
        assert not fast.began.is_set() and fast.exists(chunk.key)
        assert "not set aside: tier fast is in back-off" in caplog.text
    finally:
        store.close()


@pytest.mark.parametrize("path", READ_PATHS)
def test_a_tiers_verify_turned_on_during_a_read_does_not_vouch_for_it(path: str) -> None:
    """Whether a tier checked what it served is its ``verify`` as the read began: a flag
    turned on while an unchecked read returned used to skip the check here, and a flipped
    bit was served (and promoted)."""
    from chunkstore.testing.factories import sample_chunks
    from chunkstore.testing.store_suite import corrupt_copies

    tier = VerifyTurnedOnDuringRead(name="tier0", verify=False)
    store = _verifying_over([tier], path)
    try:
        (chunk,) = sample_chunks(1, layout=LAYOUT)
        tier.put(chunk.key, corrupt_copies(chunk)["bitflip"])
        assert _read_by(store, path, chunk.key) is None
        assert store.host.acquire(chunk.key) is None  # nothing corrupt reached host memory
        assert store.corrupt_detected == 1
    finally:
        store.close()


def test_a_non_verifying_tiers_chunk_is_judged_as_the_tier_would() -> None:
    """With ``verify``, a chunk from a tier that does not check its own reads is judged by
    that tier's own rules (a peer's MAC key and model): one of another model is a plain
    miss, not served as it was under the bare checksum check."""
    from chunkstore.backends.base import judge
    from chunkstore.testing.factories import sample_chunks

    class _OtherModelsTier(MemoryStore):
        def _judge(self, key, data):  # type: ignore[no-untyped-def]
            return judge(key, data, expected_fingerprint=b"\x01" * 32)

    tier = _OtherModelsTier(name="tier0", verify=False)
    store = TieredStore(HostCache(SLOT, num_slots=4), [tier], verify=True)
    try:
        (chunk,) = sample_chunks(1, layout=LAYOUT)
        tier.put(chunk.key, chunk.data)
        assert store.get(chunk.key) is None
        assert store.acquire(chunk.key) is None
        assert tier.exists(chunk.key) and store.corrupt_detected == 0  # refused, not damage
    finally:
        store.close()


MAC_KEY = b"m" * 32


def _compressed_with_a_mac() -> tuple[ChunkKey, bytes]:
    """A zstd chunk carrying a MAC, as a peer's writer keeps one on a cold tier."""
    from chunkstore.format import ChunkLayout, recompress
    from chunkstore.testing.factories import conversation_tokens, make_chunks, small_spec

    layout = ChunkLayout(small_spec(), authenticated=True)
    tokens = conversation_tokens(5, layout.spec.chunk_tokens)
    [chunk] = make_chunks(layout, tokens, mac_key=MAC_KEY)
    packed = recompress(chunk.data, "zstd", mac_key=MAC_KEY)
    assert len(packed) < len(chunk.data)
    return chunk.key, packed


@pytest.mark.parametrize("path", ["acquire", "prefetch", "get", "get_into"])
def test_a_compressed_chunk_keeps_its_mac_in_host_memory(path: str) -> None:
    """A zstd chunk that carries a MAC is promoted as it is, compressed: decompressing it
    re-encodes the header and payload, which the MAC covers, so without the key the MAC
    was dropped (host memory trusts its bytes and never checks one), and the chunk then left
    host memory without it: served by ``get``/``get_into``/``acquire`` once resident, read
    by ``chunkstore cp``, sent to peers (which, holding the key, refuse it)."""
    from chunkstore.format import decode_chunk

    key, packed = _compressed_with_a_mac()
    store = _tiered(4, tiers=1)
    try:
        store.tiers[0].store.put(key, packed)
        if path == "acquire":
            lease = store.acquire(key)
            assert lease is not None
            store.release(lease)
        elif path == "prefetch":
            assert store.prefetch([key]).result(timeout=30) == ["memory"]
        elif path == "get":
            assert store.get(key) == packed
        else:
            buffer = bytearray(SLOT)
            assert store.get_into(key, buffer) == len(packed)
        held = store.host.acquire(key)
        assert held is not None
        try:
            assert bytes(held.view) == packed
        finally:
            store.host.release(held)
        # and as it leaves host memory again: a host hit, a maintenance read
        for served in (store.get(key), store.read_unchecked_many([key])[0]):
            assert served is not None
            decode_chunk(served, mac_key=MAC_KEY, expected_key=key.digest)
    finally:
        store.close()
