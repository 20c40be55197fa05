"""TierList: the one read loop, presence walk and write fan-out that every tiered reader uses."""

from __future__ import annotations

from typing import Any

import pytest

from chunkstore.backends import MemoryStore
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.tiering import GuardedTier, TierList, TierWrites
from tests.tiering.doubles import FlakyStore, GatedStore


def _guarded(store: MemoryStore, metrics: ChunkstoreMetrics, timeout: float | None = 5.0):
    return GuardedTier(store, metrics.tier(store.name), timeout=timeout, retry_after=3600.0)


def _keep(_tier: GuardedTier, _key: ChunkKey, data: Any, _verified: bool) -> Any:
    return bytes(data)


@pytest.fixture
def made(metrics: ChunkstoreMetrics):
    tiers: list[GuardedTier] = []

    def make(*stores: MemoryStore, timeout: float | None = 5.0) -> TierList:
        tiers.extend(_guarded(s, metrics, timeout) for s in stores)
        return TierList(tiers[-len(stores) :])

    yield make
    for tier in tiers:
        tier.close()


def test_each_tier_is_asked_only_for_what_the_earlier_ones_did_not_serve(
    chain: list[MadeChunk], made
) -> None:
    near, far = MemoryStore(name="near"), MemoryStore(name="far")
    near.put(chain[0].key, chain[0].data)
    far.put_many([(c.key, c.data) for c in chain[:3]])
    tiers = made(near, far)
    asked: list[tuple[str, int]] = []

    def judge(tier: GuardedTier, key: ChunkKey, data: Any, verified: bool) -> Any:
        asked.append((tier.name, [c.key for c in chain].index(key)))
        return bytes(data)

    keys = [c.key for c in chain[:4]]
    got = tiers.read_many(keys, judge=judge, count=True)
    assert got == [c.data for c in chain[:3]] + [None]
    assert asked == [("near", 0), ("far", 1), ("far", 2)]
    assert (tiers[0].hits, tiers[0].misses) == (1, 3)
    assert (tiers[1].hits, tiers[1].misses) == (2, 1)


def test_a_chunk_the_judge_refuses_is_asked_of_the_next_tier(chain: list[MadeChunk], made) -> None:
    near, far = MemoryStore(name="near"), MemoryStore(name="far")
    near.put(chain[0].key, chain[0].data)
    far.put(chain[0].key, chain[0].data)
    tiers = made(near, far)

    def only_far(tier: GuardedTier, key: ChunkKey, data: Any, verified: bool) -> Any:
        return bytes(data) if tier.name == "far" else None

    assert tiers.read_many([chain[0].key], judge=only_far, count=True) == [chain[0].data]
    assert (tiers[0].hits, tiers[0].misses, tiers[1].hits) == (0, 1, 1)


def test_a_tier_in_back_off_is_skipped_and_counted_a_miss(chain: list[MadeChunk], made) -> None:
    broken, far = FlakyStore("broken"), MemoryStore(name="far")
    far.put(chain[0].key, chain[0].data)
    tiers = made(broken, far)
    broken.broken = True
    assert tiers.read_many([chain[0].key], judge=_keep, count=True) == [chain[0].data]
    assert not tiers[0].up and broken.calls == 1
    # In back-off now: refused at once, not called again, and still a miss there.
    assert tiers.read_many([chain[0].key], judge=_keep, count=True) == [chain[0].data]
    assert broken.calls == 1 and tiers[0].misses == 2
    assert tiers.exists_many([chain[0].key]) == [True]  # asked of the tiers that are up


def test_presence_stops_at_the_first_tier_that_holds_a_key(chain: list[MadeChunk], made) -> None:
    near, far = FlakyStore("near"), FlakyStore("far")
    near.put(chain[0].key, chain[0].data)
    far.put(chain[1].key, chain[1].data)
    tiers = made(near, far)
    keys = [chain[0].key, chain[1].key, chain[2].key]
    assert tiers.exists_many(keys, count=True) == [True, True, False]
    assert (tiers[0].instruments.hits._value.get(), tiers[1].instruments.hits._value.get()) == (
        1,
        1,
    )


def test_a_batch_is_written_to_every_tier_at_once(chain: list[MadeChunk], made) -> None:
    # Each gated write waits for its gate: the second tier's write must start while the
    # first one still waits, or the fan-out is one tier after another.
    first, second = GatedStore("first"), GatedStore("second")
    tiers = made(first, second)
    items = [(chain[0].key, chain[0].data)]
    writes = tiers.start_writes(TierWrites(1, len(chain[0].data), if_absent=False), items)
    assert first.entered.wait(30) and second.entered.wait(30)
    first.gate.set()
    second.gate.set()
    assert [(t.name, w, why) for t, w, why in writes.settle()] == [
        ("first", [True], ""),
        ("second", [True], ""),
    ]
    assert (tiers[0].writes, tiers[1].writes) == (1, 1)


def test_a_tier_that_cannot_take_writes_is_refused_and_counted(
    chain: list[MadeChunk], made
) -> None:
    broken, fine = FlakyStore("broken"), MemoryStore(name="fine")
    tiers = made(broken, fine)
    broken.broken = True
    items = [(chain[0].key, chain[0].data)]
    first = tiers.start_writes(TierWrites(1, 1, if_absent=False), items).settle()
    assert [(t.name, w, why) for t, w, why in first] == [
        ("broken", None, "tier_error"),
        ("fine", [True], ""),
    ]
    again = tiers.start_writes(TierWrites(1, 1, if_absent=False), items).settle()
    # Marked down by the failure: refused without a call.
    assert [(t.name, why) for t, _, why in again] == [("broken", "tier_down"), ("fine", "")]
    assert broken.calls == 1
    assert tiers[0].dropped == {"tier_error": 1, "tier_down": 1}
