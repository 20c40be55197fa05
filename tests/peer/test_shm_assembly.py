"""ShardAssemblies: a TP chunk some rank never joins is given up, not held for ever."""

from __future__ import annotations

from chunkstore.cache._lease import Lease
from chunkstore.format import ChunkLayout
from chunkstore.peer._shmassembly import MAX_AGE_S, ShardAssemblies
from chunkstore.testing.factories import sample_chunks, small_spec


class _Reserving:
    """A store lending write leases over one buffer per key; records what was given back."""

    def __init__(self) -> None:
        self.aborted: list[object] = []
        self.committed: list[object] = []

    def reserve(self, key):
        return Lease(self, key, 0, 1, memoryview(bytearray(1 << 20)), writing=True)

    def abort(self, lease):
        self.aborted.append(lease.key)

    def commit(self, lease, size=None):
        self.committed.append(lease.key)

    def release(self, lease):
        pass


def test_a_chunk_a_rank_never_joins_is_given_up_after_its_deadline() -> None:
    now = [0.0]
    reserving = _Reserving()
    tracker = ShardAssemblies(
        reserving, ChunkLayout(small_spec()), lambda _k, _v: True, clock=lambda: now[0]
    )
    stuck, later = sample_chunks(2, seed=3)
    owner = object()
    # Rank 1 joins and commits its part; rank 0 found no room and never will join.
    assert tracker.join(
        stuck.key, tp=2, rank=1, parent=stuck.parent, tokens=list(stuck.tokens), owner=owner
    )
    assert tracker.part_done(stuck.key, 1)
    now[0] = MAX_AGE_S / 2
    assert tracker.expire() == 0 and len(tracker) == 1  # still in time
    now[0] = MAX_AGE_S + 1
    # The next reservation sweeps it: the slot goes back, the late part is refused.
    assert tracker.join(
        later.key, tp=2, rank=0, parent=later.parent, tokens=list(later.tokens), owner=owner
    )
    assert reserving.aborted == [stuck.key]
    assert len(tracker) == 1  # only the new chunk
    assert not tracker.part_done(stuck.key, 0)
    assert reserving.committed == []
