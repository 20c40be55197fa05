"""HostCache: the store contract, capacity and eviction, leases and pins."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from chunkstore.cache import HostCache, StaleSlot
from chunkstore.errors import ConfigError
from chunkstore.format import ChunkLayout, seal_chunk
from chunkstore.testing.factories import MadeChunk, kv_tensors
from chunkstore.testing.stateful import store_state_machine
from chunkstore.testing.store_suite import StoreSuite
from tests.cache.conftest import SLOT


class TestHostCacheStore(StoreSuite):
    persistent = False

    @pytest.fixture
    def make_store(self) -> Callable[[], HostCache]:
        return lambda: HostCache(SLOT, num_slots=32, verify=True)


class TestHostCacheLRUStore(StoreSuite):
    persistent = False

    @pytest.fixture
    def make_store(self) -> Callable[[], HostCache]:
        return lambda: HostCache(SLOT, num_slots=32, policy="lru", verify=True)


TestHostCacheMachine = store_state_machine(
    lambda: HostCache(SLOT, num_slots=16, verify=True)
).TestCase


def test_sizes(layout: ChunkLayout) -> None:
    cache = HostCache(layout, capacity_bytes=5 * layout.total_size + 100)
    assert cache.slot_size == layout.total_size and cache.num_slots == 5
    assert cache.capacity_bytes == 5 * layout.total_size
    cache.close()
    with pytest.raises(ConfigError, match="smaller than one chunk"):
        HostCache(layout, capacity_bytes=layout.total_size - 1)
    with pytest.raises(ConfigError, match="exactly one"):
        HostCache(layout, num_slots=2, capacity_bytes=10**6)
    with pytest.raises(ConfigError, match="unknown cache policy"):
        HostCache(layout, num_slots=2, policy="mru")


def test_capacity_is_bounded_and_stats_add_up(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    with HostCache(layout, num_slots=4, policy="arc") as cache:
        assert cache.put_many([(c.key, c.data) for c in chain]) == [True] * len(chain)
        stats = cache.stats()
        assert stats.chunks == 4 and stats.evictions == len(chain) - 4
        assert stats.bytes_used == 4 * layout.total_size == stats.capacity_bytes
        # ARC with no re-references keeps the newest chunks.
        assert cache.exists_many([c.key for c in chain]) == [False] * 8 + [True] * 4
        assert cache.get(chain[0].key) is None
        assert cache.get(chain[-1].key) == chain[-1].data
        stats = cache.stats()
        assert (stats.hits, stats.misses) == (1, 1)


def test_default_policy_keeps_a_chains_head(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    # parc reads each chunk's parent from its header: a chain longer than the cache keeps
    # its first chunks (a usable prefix) and rotates its tail through the last slot.
    with HostCache(layout, num_slots=4) as cache:
        assert cache.policy_name == "parc"
        assert cache.put_many([(c.key, c.data) for c in chain]) == [True] * len(chain)
        assert cache.stats().evictions == len(chain) - 4
        assert cache.exists_many([c.key for c in chain]) == [True] * 3 + [False] * 8 + [True]


def test_oversized_chunk_is_refused(chain: list[MadeChunk]) -> None:
    with HostCache(1024, num_slots=2) as cache:
        assert cache.put(chain[0].key, chain[0].data) is False
        assert cache.stats().rejected == 1


def test_get_into_copies_exact_bytes(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    with HostCache(layout, num_slots=4) as cache:
        cache.put(chain[0].key, chain[0].data)
        target = np.zeros(layout.total_size // 2, dtype=np.uint16)
        assert cache.get_into(chain[0].key, target) == layout.total_size
        assert target.tobytes() == chain[0].data
        assert cache.get_into(chain[1].key, target) is None
        with pytest.raises(ConfigError, match="too small"):
            cache.get_into(chain[0].key, bytearray(10))
        with pytest.raises(ConfigError, match="writable"):
            cache.get_into(chain[0].key, b"\0" * layout.total_size)
        assert cache.stats().pinned_slots == 0  # errors released their pins


def test_reserve_commit_writes_in_place(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    # TP=2: each rank writes its heads straight into the slot, then the chunk is sealed.
    made = chain[3]
    with HostCache(layout, num_slots=2) as cache:
        lease = cache.reserve(made.key)
        assert lease is not None and lease.writing and len(lease.view) == layout.total_size
        assert cache.get(made.key) is None  # invisible until committed
        tensors = kv_tensors(layout, made.tokens)
        for rank in range(2):
            shard = {name: t[rank * 2 : (rank + 1) * 2] for name, t in tensors.items()}
            layout.write_shard(lease.view, rank, 2, shard)
        seal_chunk(
            layout,
            lease.view,
            key=made.key.digest,
            parent=made.parent,
            namespace=made.key.namespace,
            tokens=made.tokens,
        )
        cache.commit(lease)
        assert lease.released
        assert cache.get(made.key) == made.data
        with pytest.raises(StaleSlot):
            cache.commit(lease)


def test_abort_and_context_manager(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    with HostCache(layout, num_slots=2) as cache:
        with pytest.raises(RuntimeError), cache.reserve(chain[0].key) as lease:  # type: ignore[union-attr]
            lease.view[:4] = b"half"
            raise RuntimeError("device copy failed")
        assert lease.released and not cache.exists(chain[0].key)
        assert cache.stats().pinned_slots == 0
        with cache.reserve(chain[1].key) as lease:  # type: ignore[union-attr]
            lease.view[: len(chain[1].data)] = chain[1].data
        assert cache.get(chain[1].key) == chain[1].data
        lease.release()  # idempotent after commit
        cache.abort(lease)
        assert cache.get(chain[1].key) == chain[1].data


@pytest.mark.parametrize("policy", ["arc", "lru"])
def test_reserve_without_eviction(layout: ChunkLayout, chain: list[MadeChunk], policy: str) -> None:
    """Speculative reservations take only free slots and touch the policy only on commit."""
    with HostCache(layout, num_slots=2, policy=policy) as cache:
        cache.put(chain[0].key, chain[0].data)
        lease = cache.reserve(chain[1].key, evict=False)
        assert lease is not None
        cache.abort(lease)
        assert cache.stats().chunks == 1 and cache.stats().pinned_slots == 0
        cache.put(chain[2].key, chain[2].data)
        assert cache.reserve(chain[3].key, evict=False) is None  # full: no eviction
        stats = cache.stats()
        assert (stats.evictions, stats.rejected, stats.chunks) == (0, 0, 2)
        # Committed, it is admitted like any chunk (evicting by policy when full).
        cache.delete(chain[2].key)
        lease = cache.reserve(chain[4].key, evict=False)
        assert lease is not None
        lease.view[: len(chain[4].data)] = chain[4].data
        cache.commit(lease, len(chain[4].data))
        assert cache.get(chain[4].key) == chain[4].data
        cache.put(chain[5].key, chain[5].data)
        assert cache.stats().evictions == 1 and cache.exists(chain[5].key)


@pytest.mark.parametrize("policy", ["arc", "lru"])
def test_pinned_chunk_is_never_evicted(
    layout: ChunkLayout, chain: list[MadeChunk], policy: str
) -> None:
    with HostCache(layout, num_slots=3, policy=policy) as cache:
        cache.put(chain[0].key, chain[0].data)
        lease = cache.acquire(chain[0].key)
        assert lease is not None
        for made in chain[1:]:
            assert cache.put(made.key, made.data)
        assert cache.exists(chain[0].key)
        assert bytes(lease.view) == chain[0].data
        lease.release()
        if policy == "lru":  # (ARC keeps the twice-used chunk against a scan, by design)
            for made in chain[1:4]:
                cache.put(made.key, made.data)
            assert not cache.exists(chain[0].key)


def test_all_slots_pinned_refuses_writes(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    with HostCache(layout, num_slots=2) as cache:
        leases = [cache.reserve(c.key) for c in chain[:2]]
        assert all(lease is not None for lease in leases)
        assert cache.reserve(chain[2].key) is None
        assert cache.put(chain[2].key, chain[2].data) is False
        assert cache.stats().rejected == 2
        for lease in leases:
            cache.abort(lease)  # type: ignore[arg-type]
        assert cache.put(chain[2].key, chain[2].data) is True


def test_no_leaked_pins_after_failures(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    with HostCache(layout, num_slots=4) as cache:
        cache.put_many([(c.key, c.data) for c in chain[:4]])

        def failing_reader(made: MadeChunk) -> None:
            with cache.acquire(made.key) as lease:  # type: ignore[union-attr]
                assert bytes(lease.view[:8]) == made.data[:8]
                raise OSError("device copy failed")

        for made in chain[:4]:
            with pytest.raises(OSError):
                failing_reader(made)
        with pytest.raises(TypeError):
            cache.put(chain[5].key, object())  # not a buffer: nothing reserved
        with pytest.raises(ConfigError, match="contiguous"):
            cache.put(chain[6].key, np.zeros((4, 4), dtype=np.float32)[:, ::2])
        assert cache.stats().pinned_slots == 0
        assert cache.pool.pinned_slots() == 0
        # every slot is usable again: a full new working set fits.
        assert cache.put_many([(c.key, c.data) for c in chain[4:8]]) == [True] * 4


def test_delete_while_pinned_frees_slot_on_release(
    layout: ChunkLayout, chain: list[MadeChunk]
) -> None:
    with HostCache(layout, num_slots=2) as cache:
        cache.put(chain[0].key, chain[0].data)
        lease = cache.acquire(chain[0].key)
        assert lease is not None
        assert cache.delete(chain[0].key) is True
        assert not cache.exists(chain[0].key)
        assert bytes(lease.view) == chain[0].data  # readers keep their bytes
        assert cache.put(chain[1].key, chain[1].data)
        # The doomed slot is still pinned: room for chain[2] comes from evicting chain[1].
        assert cache.put(chain[2].key, chain[2].data)
        assert cache.exists_many([chain[1].key, chain[2].key]) == [False, True]
        assert bytes(lease.view) == chain[0].data
        lease.release()
        # Released, the doomed slot is free again: no eviction needed for one more chunk.
        assert cache.put(chain[3].key, chain[3].data)
        assert cache.exists_many([chain[2].key, chain[3].key]) == [True, True]


def test_overwrite_while_pinned_keeps_readers_consistent(chain: list[MadeChunk]) -> None:
    with HostCache(SLOT, num_slots=3) as cache:
        cache.put(chain[0].key, chain[0].data)
        lease = cache.acquire(chain[0].key)
        assert lease is not None
        replacement = bytes(reversed(chain[0].data))
        assert cache.put(chain[0].key, replacement)
        assert bytes(lease.view) == chain[0].data
        assert cache.get(chain[0].key) == replacement
        lease.release()
        assert cache.stats().chunks == 1


def test_closed_cache_refuses_use(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    cache = HostCache(layout, num_slots=2)
    cache.put(chain[0].key, chain[0].data)
    lease = cache.acquire(chain[0].key)
    cache.close()
    cache.close()
    lease.release()  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="closed"):
        cache.acquire(chain[0].key)


def test_memory_regions_hold_every_slot_view(layout: ChunkLayout, chain: list[MadeChunk]) -> None:
    """What the peer server registers with NIXL: every leased view lies inside, and it is the
    same memory (a write through the region is what the lease reads)."""
    from chunkstore.backends._memory import MemoryStore
    from chunkstore.tiering import TieredStore

    def address(view: memoryview) -> int:
        return int(np.frombuffer(view, np.uint8).ctypes.data)

    with HostCache(layout, num_slots=3) as cache:
        (region,) = cache.memory_regions()
        assert len(region) == 3 * cache.pool.slot_stride
        cache.put(chain[0].key, chain[0].data)
        read = cache.acquire(chain[0].key)
        write = cache.reserve(chain[1].key)
        assert read is not None and write is not None
        base = address(region)
        for lease in (read, write):
            start = address(lease.view)
            assert base <= start and start + len(lease.view) <= base + len(region)
            assert start - base == cache.pool.slot_offset(lease.slot)
        offset = cache.pool.slot_offset(write.slot)
        region[offset : offset + len(chain[1].data)] = chain[1].data
        cache.commit(write, len(chain[1].data))
        assert cache.get(chain[1].key) == chain[1].data
        read.release()
    with pytest.raises(ConfigError, match="closed"):
        cache.memory_regions()
    tiered = TieredStore(HostCache(layout, num_slots=2), [MemoryStore()])
    with tiered:
        (region,) = tiered.memory_regions()
        assert address(region) == address(tiered.host.memory_regions()[0])


def test_header_reads_copy_the_header_only_and_are_not_a_use(
    layout: ChunkLayout, chain: list[MadeChunk]
) -> None:
    from chunkstore.format import header_bytes_needed, read_header
    from chunkstore.hashing import ChunkKey

    with HostCache(layout, num_slots=3) as cache:
        cache.put_many([(c.key, c.data) for c in chain[:2]])
        cache.put(ChunkKey(b"\x01" * 32, chain[0].key.namespace), b"not a chunk")
        missing = chain[2].key
        got = cache.read_headers_unchecked_many([chain[0].key, missing, chain[1].key])
        assert got[1] is None
        for chunk, head in zip((chain[0], chain[1]), (got[0], got[2])):
            assert head is not None
            assert len(head) == header_bytes_needed(chunk.data[:8]) < len(chunk.data)
            assert head == chunk.data[: len(head)]
            assert read_header(head) == read_header(chunk.data)
        # Bytes that are not a chunk come back up to what their first 8 bytes say, at most.
        (odd,) = cache.read_headers_unchecked_many([ChunkKey(b"\x01" * 32, chain[0].key.namespace)])
        assert odd == b"not a chunk"
        stats = cache.stats()
        assert (stats.hits, stats.misses) == (0, 0)
