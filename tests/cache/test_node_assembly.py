"""NodeAssemblies: a TP chunk some rank never joins is given up, not held for ever, and parts
of two engines never make one chunk."""

from __future__ import annotations

from typing import Any

from chunkstore.cache._lease import Lease
from chunkstore.cache.assembly._node import MAX_AGE_S, NodeAssemblies, RankPart
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import MadeChunk, sample_chunks, small_spec


class _Reserving:
    """A store lending write leases over one buffer per key; records what was given back."""

    def __init__(self) -> None:
        self.aborted: list[object] = []
        self.committed: list[object] = []
        self.leases: list[Lease] = []

    def reserve(self, key):
        lease = Lease(self, key, len(self.leases), 1, memoryview(bytearray(1 << 20)), writing=True)
        self.leases.append(lease)
        return lease

    def abort(self, lease):
        self.aborted.append(lease.key)

    def commit(self, lease, size=None):
        self.committed.append((lease.key, lease.slot))

    def release(self, lease):
        pass


def join(tracker: NodeAssemblies, part: RankPart, chunk: MadeChunk, owner: object) -> Any:
    """``part``'s rank reserves its share of ``chunk`` (of TP 2) for session ``owner``."""
    return tracker.join(part, tp=2, parent=chunk.parent, tokens=list(chunk.tokens), owner=owner)


def test_a_chunk_a_rank_never_joins_is_given_up_after_its_deadline() -> None:
    now = [0.0]
    reserving = _Reserving()
    tracker = NodeAssemblies(
        reserving, ChunkLayout(small_spec()), lambda _k, _v: True, clock=lambda: now[0]
    )
    stuck, later = sample_chunks(2, seed=3)
    owner = object()
    # Rank 1 joins and commits its part; rank 0 found no room and never will join.
    part = RankPart(stuck.key, 1, b"engine")
    assert join(tracker, part, stuck, owner)
    assert tracker.part_done(part)
    now[0] = MAX_AGE_S / 2
    assert tracker.expire() == 0 and len(tracker) == 1  # still in time
    now[0] = MAX_AGE_S + 1
    # The next reservation sweeps it: the slot goes back, the late part is refused.
    assert join(tracker, RankPart(later.key, 0, b"engine"), later, owner)
    assert reserving.aborted == [stuck.key]
    assert len(tracker) == 1  # only the new chunk
    assert not tracker.part_done(RankPart(stuck.key, 0, b"engine"))
    assert reserving.committed == []


def test_parts_of_two_engines_assemble_in_a_slot_each() -> None:
    reserving = _Reserving()
    tracker = NodeAssemblies(reserving, ChunkLayout(small_spec()), lambda _k, _v: True)
    chunk = sample_chunks(1, seed=4)[0]
    a0, a1 = (RankPart(chunk.key, r, b"engine-a") for r in range(2))
    b0, b1 = (RankPart(chunk.key, r, b"engine-b") for r in range(2))
    engine_a, engine_b = object(), object()
    slot_a, slot_b = join(tracker, a0, chunk, engine_a), join(tracker, b1, chunk, engine_b)
    assert slot_a is not None and slot_b is not None and slot_a != slot_b
    assert tracker.part_done(a0) and tracker.part_done(b1)
    assert reserving.committed == []  # rank 0 of A and rank 1 of B make no chunk
    # Each engine's own ranks complete its chunk, in its own slot.
    assert join(tracker, a1, chunk, engine_a) == slot_a and tracker.part_done(a1)
    assert reserving.committed == [(chunk.key, slot_a[0])]
    # One engine's rank leaving gives up its engine's chunk only.
    assert join(tracker, b0, chunk, engine_b) == slot_b
    tracker.leave(b0)
    assert reserving.aborted == [chunk.key] and len(tracker) == 0
    assert not tracker.part_done(b1)


def test_a_rank_that_ends_gives_up_only_its_own_engines_chunk() -> None:
    reserving = _Reserving()
    tracker = NodeAssemblies(reserving, ChunkLayout(small_spec()), lambda _k, _v: True)
    chunk = sample_chunks(1, seed=5)[0]
    engine_a, engine_b = object(), object()
    for engine, owner in ((b"engine-a", engine_a), (b"engine-b", engine_b)):
        assert join(tracker, RankPart(chunk.key, 0, engine), chunk, owner)
    tracker.owner_gone(engine_a)
    assert reserving.aborted == [chunk.key] and len(tracker) == 1
    assert join(tracker, RankPart(chunk.key, 1, b"engine-b"), chunk, engine_b)
    assert tracker.part_done(RankPart(chunk.key, 0, b"engine-b"))
    assert tracker.part_done(RankPart(chunk.key, 1, b"engine-b"))
    assert reserving.committed == [(chunk.key, 1)]
