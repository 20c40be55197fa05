"""TP shard assembly: ranks write head shards into one shared slot; the owner publishes once."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends.base import Buffer
from chunkstore.cache import AssemblyOwner, HostCache, ShardAssembler
from chunkstore.cache._pool import ABORTED, CLAIMED, LENT, SHM_DIR
from chunkstore.cache.assembly._assembler import process_alive, writer_mask
from chunkstore.errors import ConfigError, KeyMismatch
from chunkstore.format import ChunkLayout, encode_chunk, mac_key_from_secret
from chunkstore.hashing import ChunkKey
from chunkstore.testing.factories import MadeChunk, kv_tensors, make_chunks, small_spec
from chunkstore.tiering import TieredStore
from tests.cache.tp_worker import conversation, die_mid_write, layout_named, serve

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")

TPS = (1, 2, 4)


class CountingFsStore(FsStore):
    """A directory store that counts how often each key is written."""

    def __init__(self, root: str) -> None:
        super().__init__(root, create=True)
        self.writes: Counter[ChunkKey] = Counter()

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        self.writes.update(key for key, _ in items)
        return super().put_many(items)


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"chunkstore-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    Path(SHM_DIR, name).unlink(missing_ok=True)


class Ranks:
    """Four long-lived rank processes (spawned once per module: imports cost more than work)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.replies: Any = context.Queue()
        self.commands: list[Any] = [context.Queue() for _ in range(4)]
        self.processes = [
            context.Process(target=serve, args=(q, self.replies), daemon=True)
            for q in self.commands
        ]
        for process in self.processes:
            process.start()

    def run(self, op: str, pool: str, layout: str, seed: int, tp: int) -> list[tuple[Any, ...]]:
        """Send one command to ranks 0..tp-1 (running concurrently); their replies by rank."""
        for rank in range(tp):
            self.commands[rank].put((op, pool, layout, seed, rank, tp))
        replies = sorted((self.replies.get(timeout=60) for _ in range(tp)), key=lambda r: r[1])
        errors = [r for r in replies if r[0] == "error"]
        assert not errors, errors
        return replies

    def close(self) -> None:
        for queue in self.commands:
            queue.put(("exit",))
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    group = Ranks()
    yield group
    group.close()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` for at most 30 s (it normally holds within milliseconds)."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def chunk_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.kvc"))}


# --- separate rank processes sharing one pool ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout_name", ["gqa", "rep", "mla"])
def test_tp_1_2_4_write_byte_identical_chunk_files(
    ranks: Ranks, tmp_path: Path, layout_name: str
) -> None:
    layout = layout_named(layout_name)
    chunks = conversation(layout, seed=7)
    files: dict[int, dict[str, bytes]] = {}
    for tp in TPS:
        name = f"chunkstore-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tier = CountingFsStore(str(tmp_path / f"tp{tp}"))
        tiered = TieredStore(HostCache(layout, num_slots=16, shm_name=name), [tier])
        # A long sweep interval: publication here is driven by the ranks' wake-ups.
        owner = AssemblyOwner(tiered, lend_slots=8, sweep_interval=30.0).start()
        try:
            replies = ranks.run("write", name, layout_name, 7, tp)
            writers = writer_mask(layout, tp)
            for _, rank, took_part, _ in replies:
                assert took_part == (len(chunks) if writers >> rank & 1 else 0)
            assert sum(sealed for *_, sealed in replies) == len(chunks)
            wait_for(lambda o=owner: o.stats().published == len(chunks), "publication")
            assert tiered.flush(timeout=30)
            # Each rank, in its own process, reads back exactly its heads.
            assert all(ok for _, _, ok in ranks.run("read", name, layout_name, 7, tp))
            assert tier.writes == Counter({c.key: 1 for c in chunks})
            assert owner.stats().duplicates == 0
        finally:
            owner.close()
            tiered.close()
        files[tp] = chunk_files(tmp_path / f"tp{tp}")
        assert tiered.host.pool.closed
    expected = {c.key.path: c.data for c in chunks}
    for tp in TPS:
        assert files[tp] == expected, f"tp={tp} wrote different chunk files"


@pytest.mark.slow
def test_rank_dying_mid_write_publishes_nothing_and_frees_the_slot(
    tmp_path: Path, shm_name: str
) -> None:
    layout = layout_named("gqa")
    chunk = conversation(layout, seed=3)[0]
    skew = [0.0]
    tier = CountingFsStore(str(tmp_path / "kv"))
    tiered = TieredStore(HostCache(layout, num_slots=8, shm_name=shm_name), [tier])
    owner = AssemblyOwner(
        tiered, lend_slots=2, claim_timeout=30.0, clock=lambda: time.monotonic() + skew[0]
    )
    rank0 = ShardAssembler.attach(shm_name, layout, rank=0, tp=2)
    try:
        full = kv_tensors(layout, chunk.tokens)
        claim = rank0.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
        assert claim is not None
        with claim:
            rank0.write_shard(claim, layout.shard_of(full, 0, 2))
        context = multiprocessing.get_context("spawn")
        dying = context.Process(target=die_mid_write, args=(shm_name, "gqa", 3, 1, 2))
        dying.start()
        dying.join(timeout=60)
        assert dying.exitcode == 3
        pool = tiered.host.pool

        # Within the timeout the claim waits for rank 1; nothing is visible.
        assert owner.collect() == []
        assert pool.state(claim.slot) == CLAIMED
        assert rank0.acquire(chunk.key) is None and not tiered.exists(chunk.key)

        skew[0] = 31.0
        assert owner.collect() == []
        stats = owner.stats()
        assert (stats.aborted, stats.writers_lost, stats.reclaimed) == (1, 1, 1)
        assert pool.state(claim.slot) == LENT
        assert tiered.host.stats().pinned_slots == 0
        assert rank0.read_shard(chunk.key) is None
        assert tiered.flush(timeout=30) and not tier.writes
        assert chunk_files(tmp_path / "kv") == {}

        # The slot is usable again: both ranks write the chunk, it is published once.
        skew[0] = 0.0
        with ShardAssembler(pool, layout, rank=1, tp=2) as rank1:
            for rank, asm in ((1, rank1), (0, rank0)):
                again = asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
                assert again is not None
                with again:
                    asm.write_shard(again, layout.shard_of(full, rank, 2))
        assert owner.collect() == [chunk.key]
        assert tiered.flush(timeout=30)
        assert tier.writes == Counter({chunk.key: 1})
        assert chunk_files(tmp_path / "kv") == {chunk.key.path: chunk.data}
    finally:
        rank0.close()
        owner.close()
        tiered.close()


# --- the protocol, in one process -----------------------------------------------------------------


@pytest.fixture
def gqa() -> ChunkLayout:
    return ChunkLayout(small_spec(num_kv_heads=4))


@pytest.fixture
def made(gqa: ChunkLayout) -> list[MadeChunk]:
    return conversation(gqa, seed=11)


def assemblers(host: HostCache, layout: ChunkLayout, tp: int, **kw: Any) -> list[ShardAssembler]:
    return [ShardAssembler(host.pool, layout, rank=r, tp=tp, **kw) for r in range(tp)]


def write(asm: ShardAssembler, chunk: MadeChunk) -> bool | None:
    """This rank's part of ``chunk``: None when there is nothing to write, else sealed?"""
    claim = asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
    if claim is None:
        return None
    asm.write_shard(
        claim, asm.layout.shard_of(kv_tensors(asm.layout, chunk.tokens), asm.rank, asm.tp)
    )
    return asm.mark_written(claim)


def test_the_last_writer_seals_and_the_owner_publishes_once(
    gqa: ChunkLayout, made: list[MadeChunk]
) -> None:
    with HostCache(gqa, num_slots=8) as host:
        owner = AssemblyOwner(host, lend_slots=2)
        ranks = assemblers(host, gqa, 4)
        chunk = made[0]
        assert [write(ranks[r], chunk) for r in (2, 0, 3)] == [False, False, False]
        assert not host.exists(chunk.key) and owner.collect() == []
        assert write(ranks[1], chunk) is True
        assert not host.exists(chunk.key)  # sealed, but not yet adopted by the owner
        assert owner.collect() == [chunk.key]
        assert owner.collect() == []
        assert host.get(chunk.key) == chunk.data
        assert owner.stats().published == 1
        # Written already: every rank now has nothing to do for this key.
        assert [write(r, chunk) for r in ranks] == [None] * 4
        assert [r.stats().present for r in ranks] == [1] * 4
        assert host.stats().lent_slots == 2
        owner.close()
        assert host.stats().lent_slots == 0
        assert host.put(made[1].key, made[1].data)  # the slots serve the cache again


def test_a_sealed_chunk_outlives_an_aborted_speculative_reservation(
    gqa: ChunkLayout, made: list[MadeChunk]
) -> None:
    # A reader's promotion reserves the key without eviction while the ranks assemble it;
    # the tier then misses and the promotion aborts. The sealed chunk must stay cached.
    with HostCache(gqa, num_slots=4) as host:
        owner = AssemblyOwner(host, lend_slots=1)
        (solo,) = assemblers(host, gqa, 1)
        chunk = made[0]
        claim = solo.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
        assert claim is not None
        speculative = host.reserve(chunk.key, evict=False)
        assert speculative is not None
        solo.write_shard(claim, kv_tensors(gqa, chunk.tokens))
        assert solo.mark_written(claim) is True
        assert owner.collect() == [chunk.key]
        host.abort(speculative)
        assert host.get(chunk.key) == chunk.data
        assert owner.stats().published == 1
        owner.close()
        assert host.stats().pinned_slots == 0


def test_replica_and_mla_ranks_write_nothing() -> None:
    rep = layout_named("rep")
    assert writer_mask(rep, 4) == 0b0101 and writer_mask(rep, 2) == 0b11
    mla = layout_named("mla")
    assert writer_mask(mla, 4) == 0b0001
    chunk = conversation(mla, seed=2)[0]
    with HostCache(mla, num_slots=4) as host:
        owner = AssemblyOwner(host, lend_slots=1)
        ranks = assemblers(host, mla, 4)
        assert [r.writes for r in ranks] == [True, False, False, False]
        assert [write(r, chunk) for r in reversed(ranks)] == [None, None, None, True]
        assert owner.collect() == [chunk.key]
        assert host.get(chunk.key) == chunk.data
        # Every rank reads the whole latent (it is not split between ranks).
        latent = kv_tensors(mla, chunk.tokens)["layers.1.latent"]
        for r in ranks:
            got = r.read_shard(chunk.key)
            assert got is not None and got["layers.1.latent"].tobytes() == latent.tobytes()


def test_read_shard_returns_exactly_the_ranks_heads(
    gqa: ChunkLayout, made: list[MadeChunk]
) -> None:
    chunk = made[1]
    full = kv_tensors(gqa, chunk.tokens)
    with HostCache(gqa, num_slots=4) as host:
        host.put(chunk.key, chunk.data)
        for tp in TPS:
            for asm in assemblers(host, gqa, tp):
                got = asm.read_shard(chunk.key)
                assert got is not None
                for name, tensor in gqa.shard_of(full, asm.rank, tp).items():
                    assert got[name].shape == (4 // tp, 16, 8)
                    assert got[name].tobytes() == tensor.tobytes()
                lease = asm.acquire(chunk.key)
                assert lease is not None and host.stats().pinned_slots == 1
                with lease:
                    assert bytes(lease.view) == chunk.data
                assert host.stats().pinned_slots == 0
        assert assemblers(host, gqa, 2)[0].read_shard(made[2].key) is None


def test_read_shard_decodes_a_compressed_chunk_kept_with_its_mac() -> None:
    """Host memory keeps a zstd chunk that carries a MAC as it came (decompressing it
    without the key would drop the MAC): a rank reading its heads of such a chunk decodes it,
    as every reader of host memory must. The size of the slot told it apart and made it a
    miss, though the chunk was there, promoted into the engine's shared pool."""
    from chunkstore.backends._memory import MemoryStore
    from chunkstore.format import recompress
    from chunkstore.testing.factories import conversation_tokens

    mac_key = b"k" * 32
    layout = ChunkLayout(small_spec(num_kv_heads=4), authenticated=True)
    [chunk] = make_chunks(layout, conversation_tokens(7, layout.spec.chunk_tokens), mac_key=mac_key)
    packed = recompress(chunk.data, "zstd", mac_key=mac_key)
    cold = MemoryStore()
    cold.put(chunk.key, packed)
    full = kv_tensors(layout, chunk.tokens)
    store = TieredStore(HostCache(layout, num_slots=4), [cold])
    try:
        lease = store.acquire(chunk.key)  # promoted into host memory, compressed
        assert lease is not None and bytes(lease.view) == packed
        store.release(lease)
        for tp in TPS:
            for asm in assemblers(store.host, layout, tp, mac_key=mac_key):
                got = asm.read_shard(chunk.key)
                assert got is not None
                for name, tensor in layout.shard_of(full, asm.rank, tp).items():
                    assert got[name].tobytes() == tensor.tobytes()
        assert store.host.stats().pinned_slots == 0
    finally:
        store.close()


def test_claims_check_key_tokens_and_tp(gqa: ChunkLayout, made: list[MadeChunk]) -> None:
    with HostCache(gqa, num_slots=4) as host:
        AssemblyOwner(host, lend_slots=2)
        asm = ShardAssembler(host.pool, gqa, rank=0, tp=2)
        chunk = made[0]
        with pytest.raises(KeyMismatch):
            asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=made[1].tokens)
        with pytest.raises(ConfigError, match="32-byte"):
            asm.slot_for_write(chunk.key, parent=chunk.parent[:16], tokens=chunk.tokens)
        with pytest.raises(ConfigError, match="covers 16 tokens"):
            asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens[:8])
        claim = asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
        assert claim is not None
        # The same rank asking again while writing gets nothing (no double join).
        assert asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens) is None
        other_tp = ShardAssembler(host.pool, gqa, rank=1, tp=4)
        with pytest.raises(ConfigError, match="tp=2"):
            other_tp.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
        with pytest.raises(ConfigError):
            ShardAssembler(host.pool, gqa, rank=2, tp=2)
        big = ChunkLayout(small_spec(num_kv_heads=8))
        with pytest.raises(ConfigError, match="slots hold"):
            ShardAssembler(host.pool, big, rank=0, tp=1)


def test_abandoned_claim_is_never_published_and_its_slot_returns(
    gqa: ChunkLayout, made: list[MadeChunk]
) -> None:
    with HostCache(gqa, num_slots=4) as host:
        owner = AssemblyOwner(host, lend_slots=1)
        r0, r1 = assemblers(host, gqa, 2)
        chunk = made[0]
        assert write(r0, chunk) is False
        with pytest.raises(RuntimeError):
            with r1.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens):
                raise RuntimeError("device copy failed")
        assert host.pool.state(host.loans.lent()[0]) == ABORTED
        assert owner.collect() == []
        assert owner.stats().reclaimed == 1 and not host.exists(chunk.key)
        assert host.pool.state(host.loans.lent()[0]) == LENT
        assert r1.stats().aborted == 1


def test_slow_writer_keeps_an_aborted_slot_until_it_finishes(
    gqa: ChunkLayout, made: list[MadeChunk]
) -> None:
    skew = [0.0]
    with HostCache(gqa, num_slots=4) as host:
        owner = AssemblyOwner(
            host, lend_slots=1, claim_timeout=5.0, clock=lambda: time.monotonic() + skew[0]
        )
        r0, r1 = assemblers(host, gqa, 2)
        chunk = made[0]
        slow = r1.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
        assert slow is not None
        skew[0] = 6.0
        assert owner.collect() == []
        assert owner.stats().aborted == 1 and owner.stats().reclaimed == 0
        assert host.pool.state(slow.slot) == ABORTED  # rank 1 (alive) is still inside
        skew[0] = 0.0
        # Rank 0 arrives late: the aborted claim is invisible, so it opens a new one.
        assert write(r0, chunk) is False
        assert r1.mark_written(slow) is False
        assert owner.collect() == []
        assert owner.stats().reclaimed == 1 and not host.exists(chunk.key)
        # Rank 1 retries its save and completes the new claim.
        assert write(r1, chunk) is True
        assert owner.collect() == [chunk.key]
        assert host.get(chunk.key) == chunk.data
        assert host.stats().pinned_slots == 0


def test_exhausted_loans_skip_then_recover(gqa: ChunkLayout, made: list[MadeChunk]) -> None:
    with HostCache(gqa, num_slots=4) as host:
        owner = AssemblyOwner(host, lend_slots=1)
        (solo,) = assemblers(host, gqa, 1)
        assert write(solo, made[0]) is True
        assert write(solo, made[1]) is None and solo.stats().no_slot == 1
        assert owner.collect() == [made[0].key]
        assert write(solo, made[1]) is True
        assert owner.collect() == [made[1].key]


def test_lending_evicts_by_policy_but_never_a_pinned_chunk(
    gqa: ChunkLayout, made: list[MadeChunk]
) -> None:
    with HostCache(gqa, num_slots=4, policy="lru") as host:
        host.put_many([(c.key, c.data) for c in made[:4]])
        pinned = host.acquire(made[0].key)
        assert pinned is not None
        owner = AssemblyOwner(host, lend_slots=2)
        assert host.stats().evictions == 2 and host.stats().lent_slots == 2
        assert host.exists(made[0].key) and not host.exists(made[1].key)
        assert host.exists(made[3].key)
        (solo,) = assemblers(host, gqa, 1)
        assert write(solo, made[4]) is True and write(solo, made[5]) is True
        assert set(owner.collect()) == {made[4].key, made[5].key}
        assert host.exists(made[0].key)
        pinned.release()


def test_chunk_cached_meanwhile_is_a_duplicate(gqa: ChunkLayout, made: list[MadeChunk]) -> None:
    with HostCache(gqa, num_slots=4) as host:
        owner = AssemblyOwner(host, lend_slots=1)
        (solo,) = assemblers(host, gqa, 1)
        claim = solo.slot_for_write(made[0].key, parent=made[0].parent, tokens=made[0].tokens)
        assert claim is not None
        host.put(made[0].key, made[0].data)
        solo.write_shard(claim, kv_tensors(gqa, made[0].tokens))
        assert solo.mark_written(claim) is True
        assert owner.collect() == []
        assert owner.stats().duplicates == 1 and host.stats().lent_slots == 1
        assert host.get(made[0].key) == made[0].data


def test_authenticated_layout_seals_with_the_mac() -> None:
    layout = ChunkLayout(small_spec(), authenticated=True)
    mac = mac_key_from_secret("test secret")
    chunk = make_chunks(layout, np.arange(16, dtype=np.uint32), mac_key=mac)[0]
    with HostCache(layout, num_slots=2) as host:
        owner = AssemblyOwner(host, lend_slots=1)
        ranks = assemblers(host, layout, 2, mac_key=mac)
        assert [write(r, chunk) for r in ranks] == [False, True]
        assert owner.collect() == [chunk.key]
        assert host.get(chunk.key) == chunk.data
        full = kv_tensors(layout, chunk.tokens)
        assert (
            bytes(
                encode_chunk(
                    layout,
                    key=chunk.key.digest,
                    parent=chunk.parent,
                    namespace=chunk.key.namespace,
                    tokens=chunk.tokens,
                    tensors=full,
                    mac_key=mac,
                )
            )
            == chunk.data
        )
    with pytest.raises(ConfigError, match="mac_key"):
        with HostCache(layout, num_slots=2) as host:
            ShardAssembler(host.pool, layout, rank=0, tp=1)


def test_owner_thread_publishes_into_the_tiered_store(
    gqa: ChunkLayout, made: list[MadeChunk], shm_name: str, tmp_path: Path
) -> None:
    tier = CountingFsStore(str(tmp_path / "kv"))
    tiered = TieredStore(HostCache(gqa, num_slots=8, shm_name=shm_name), [tier])
    published: list[ChunkKey] = []
    with AssemblyOwner(
        tiered, lend_slots=4, sweep_interval=30.0, on_publish=published.extend
    ).start() as owner:
        ranks = [ShardAssembler.attach(shm_name, gqa, rank=r, tp=2) for r in range(2)]
        for chunk in made[:3]:
            for r in ranks:
                write(r, chunk)
        wait_for(lambda: owner.stats().published == 3, "publication")
        for r in ranks:
            r.close()
    assert sorted(k.hex for k in published) == sorted(c.key.hex for c in made[:3])
    assert tiered.flush(timeout=30)
    assert tier.writes == Counter({c.key: 1 for c in made[:3]})
    tiered.close()


def test_process_alive_treats_zombies_as_dead() -> None:
    assert process_alive(os.getpid())
    assert not process_alive(0)
    child = subprocess.Popen(["true"])
    wait_for(lambda: not process_alive(child.pid), "the child to exit")  # a zombie until reaped
    child.wait(timeout=30)
    assert not process_alive(child.pid)


def test_a_restarted_rank_writes_off_what_its_predecessor_left(
    gqa: ChunkLayout, made: list[MadeChunk]
) -> None:
    with HostCache(gqa, num_slots=4) as host:
        owner = AssemblyOwner(host, lend_slots=1)
        r0, r1 = assemblers(host, gqa, 2)
        chunk = made[0]
        assert write(r0, chunk) is False
        stuck = r1.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
        assert stuck is not None
        host.pool.rank_pids[1] = 1  # as if another (live) process had been rank 1
        ShardAssembler(host.pool, gqa, rank=1, tp=2)
        assert host.pool.state(stuck.slot) == ABORTED
        assert owner.collect() == [] and owner.stats().reclaimed == 1
        assert host.pool.state(stuck.slot) == LENT and not host.exists(chunk.key)


def test_random_interleaving_keeps_every_slot_accounted_for(gqa: ChunkLayout) -> None:
    """Owner puts, deletes and reads mixed with rank claims, aborts and owner passes (seeded)."""
    import random

    chain = conversation(gqa, seed=5) + conversation(gqa, seed=6)
    by_key = {c.key: c for c in chain}
    rng = random.Random(1234)
    with HostCache(gqa, num_slots=6) as host:
        owner = AssemblyOwner(host, lend_slots=2)
        ranks = assemblers(host, gqa, 2)
        held: list[Any] = []
        open_claims: list[Any] = []
        for _ in range(400):
            op = rng.randrange(7)
            chunk = rng.choice(chain)
            if op == 0:
                host.put(chunk.key, chunk.data)
            elif op == 1:
                got = host.get(chunk.key)
                assert got is None or got == chunk.data
            elif op == 2 and len(held) < 2:
                lease = host.acquire(chunk.key)
                if lease is not None:
                    held.append(lease)
            elif op == 2 and held:
                held.pop(rng.randrange(len(held))).release()
            elif op == 3:
                asm = rng.choice(ranks)
                claim = asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
                if claim is not None:
                    full = kv_tensors(gqa, chunk.tokens)
                    asm.write_shard(claim, gqa.shard_of(full, asm.rank, 2))
                    open_claims.append((asm, claim))
            elif op == 4 and open_claims:
                asm, claim = open_claims.pop(rng.randrange(len(open_claims)))
                if rng.random() < 0.2:
                    asm.abandon(claim)
                else:
                    asm.mark_written(claim)
            elif op == 5:
                owner.collect()
            elif op == 6:
                host.delete(chunk.key)
            # Every slot is in exactly one place (white-box: the cache's own books).
            places = [
                set(host._free),
                set(host._index.values()),
                set(host.loans.lent()),
                host._doomed,
            ]
            assert sum(len(p) for p in places) == host.num_slots
            assert set().union(*places) == set(range(host.num_slots))
            for info in host.list():
                assert host.get(info.key) == by_key[info.key].data
        for lease in held:
            lease.release()
        for asm, claim in open_claims:
            asm.abandon(claim)
        owner.collect()
        assert host.stats().pinned_slots == 0
        assert owner.stats().published > 0 and owner.stats().reclaimed > 0
