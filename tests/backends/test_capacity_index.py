"""A shared store's cap kept in a capacity index (real redis-server on 127.0.0.1).

The store suite on an indexed filesystem and S3 store; the cap held by concurrent writers
with no lock; writers killed with -9 and a server that goes away, repaired by a reconcile;
sharded reconciles; eviction that never walks the store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends import _index, _layout
from chunkstore.backends._fs import FsStore
from chunkstore.backends._index import parse_shard, shard_of
from chunkstore.errors import ConfigError, StoreError
from chunkstore.testing.factories import MadeChunk, sample_chunks
from chunkstore.testing.store_suite import StoreSuite
from tests.services import (
    JuiceFsVolume,
    S3Service,
)

CHUNKS = sample_chunks(40, seed=5)
SIZE = len(CHUNKS[0].data)


def disk_usage(store: FsStore) -> tuple[int, int]:
    infos = list(store.list())
    return sum(i.size for i in infos), len(infos)


class TestIndexedFsStore(StoreSuite):
    @pytest.fixture
    def make_store(self, tmp_path: Path, redis_url: str) -> Callable[[], FsStore]:
        return lambda: FsStore(
            str(tmp_path / "s"), create=True, access_resolution=0, index=redis_url
        )


class TestIndexedS3Store(StoreSuite):
    time_resolution = 1.05

    @pytest.fixture
    def make_store(self, s3_endpoint: str, s3_bucket: str, redis_url: str) -> Callable[[], object]:
        pytest.importorskip("s3fs")
        from chunkstore.backends._s3 import S3Store

        prefix = f"indexed/{uuid.uuid4().hex[:8]}"
        return lambda: S3Store(
            s3_bucket,
            prefix,
            endpoint_url=s3_endpoint,
            access_resolution=0,
            backoff=0.001,
            index=redis_url,
        )


def test_s3_cap_needs_an_index(s3_endpoint: str, s3_bucket: str) -> None:
    pytest.importorskip("s3fs")
    from chunkstore.backends._s3 import S3Store

    with pytest.raises(ConfigError, match="capacity index"):
        S3Store(s3_bucket, "capped", endpoint_url=s3_endpoint, max_bytes="1M")


def test_s3_cap_evicts_least_recently_used(
    s3_endpoint: str, s3_bucket: str, redis_url: str
) -> None:
    pytest.importorskip("s3fs")
    from chunkstore.backends._s3 import S3Store

    store = S3Store(
        s3_bucket,
        f"capped/{uuid.uuid4().hex[:8]}",
        endpoint_url=s3_endpoint,
        max_bytes=4 * SIZE,
        index=redis_url,
        backoff=0.001,
    )
    store.put_many([(c.key, c.data) for c in CHUNKS[:10]])
    assert [info.key for info in store.list()] != []
    held = {info.key for info in store.list()}
    assert held == {c.key for c in CHUNKS[6:10]}
    assert store.index is not None and store.index.usage().bytes == 4 * SIZE


def test_usage_never_passes_cap_plus_one_chunk_per_writer(tmp_path: Path, redis_url: str) -> None:
    root = str(tmp_path / "s")
    cap = 8 * SIZE
    writers = 4
    stores = [FsStore(root, create=True, max_bytes=cap, index=redis_url) for _ in range(writers)]
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.append(disk_usage(stores[0])[0])
            time.sleep(0.002)

    def write(store: FsStore, chunks: list[MadeChunk]) -> None:
        for chunk in chunks:
            store.put(chunk.key, chunk.data)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [
        threading.Thread(target=write, args=(stores[i], CHUNKS[i::writers])) for i in range(writers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    sampler.join()
    assert seen and max(seen) <= cap + writers * SIZE
    used, count = disk_usage(stores[0])
    assert used <= cap
    for store in stores:  # each writer's last accounts, sent after its publishes
        assert store.index is not None
        store.index.flush()
    index = stores[0].index
    assert index is not None
    assert (index.usage().bytes, index.usage().chunks) == (used, count)
    assert sum(s.index.evicted for s in stores if s.index is not None) == len(CHUNKS) - count


def test_reads_keep_a_chunk_from_eviction(tmp_path: Path, redis_url: str) -> None:
    store = FsStore(
        str(tmp_path / "s"), create=True, max_bytes=4 * SIZE, access_resolution=0, index=redis_url
    )
    for chunk in CHUNKS[:4]:
        store.put(chunk.key, chunk.data)
        time.sleep(0.01)
    assert store.get(CHUNKS[0].key) is not None  # the oldest write, now the latest use
    store.put(CHUNKS[4].key, CHUNKS[4].data)
    assert store.index is not None
    store.index.flush()  # the writer's last chunk is accounted behind it
    assert store.exists(CHUNKS[0].key) and not store.exists(CHUNKS[1].key)


def test_evict_never_walks_the_store(tmp_path: Path, redis_url: str) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    for chunk in CHUNKS[:10]:
        store.put(chunk.key, chunk.data)
        time.sleep(0.005)
    index = store.index
    assert index is not None

    def no_walk(shard: object) -> Iterator[tuple[str, int, float]]:
        raise AssertionError("eviction walked the store")

    index._scan = no_walk
    assert index.evict(max_bytes=6 * SIZE) == 4
    assert {i.key for i in store.list()} == {c.key for c in CHUNKS[4:10]}
    time.sleep(0.05)
    store.put(CHUNKS[10].key, CHUNKS[10].data)
    assert index.evict(older_than=0.04) == 6  # everything but the chunk written just now
    assert [i.key for i in store.list()] == [CHUNKS[10].key]
    assert index.usage().bytes == SIZE


_WRITER = """
import sys
from chunkstore.backends import _index
from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks
_index.CREDIT_SHARE = _index.CREDIT_TOTAL_SHARE = 2  # credit of 10 chunks: dies holding some
store = FsStore(sys.argv[1], create=True, max_bytes=int(sys.argv[3]), index=sys.argv[2])
chunks = sample_chunks(400, seed=int(sys.argv[4]))
print("ready", flush=True)  # the kills below land among the puts
for chunk in chunks:
    store.put(chunk.key, chunk.data)
"""


def test_writers_killed_at_any_point_are_repaired_by_reconcile(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = str(tmp_path / "s")
    cap = 20 * SIZE
    FsStore(root, create=True)  # the marker, before the writers race to make it
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, root, redis_url, str(cap), str(seed)],
            stdout=subprocess.PIPE,
            cwd=str(Path(__file__).resolve().parents[2]),
        )
        for seed in (1, 2, 3)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().startswith(b"ready")
    for delay, proc in zip((0.05, 0.2, 0.4), procs):
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # the writers are dead: their credit need not wait out the grace to be given back
    monkeypatch.setattr(_index, "CREDIT_GRACE", 0.0)
    store = FsStore(root, max_bytes=cap, index=redis_url)
    index = store.index
    assert index is not None
    assert index.client.hlen(index._credit_keys[6]) > 0  # the dead writers' credit
    result = index.reconcile()
    used, count = disk_usage(store)
    assert (index.usage().bytes, index.usage().chunks) == (used, count)
    assert result.walked == count
    assert _credit_counted(index) == (0, 0)
    index.evict()
    used, count = disk_usage(store)
    assert used <= cap and (index.usage().bytes, index.usage().chunks) == (used, count)


def test_sharded_reconciles_repair_everything(tmp_path: Path, redis_url: str) -> None:
    root = str(tmp_path / "s")
    FsStore(root, create=True).put_many([(c.key, c.data) for c in CHUNKS[:20]])  # unindexed
    indexed = FsStore(root, index=redis_url)
    assert indexed.index is not None
    indexed.put(CHUNKS[20].key, CHUNKS[20].data)
    indexed.index.flush()  # uncapped, the put did not wait for its accounting
    shards = [FsStore(root, index=redis_url).index for _ in range(3)]
    results = [index.reconcile(shard=(i, 3)) for i, index in enumerate(shards) if index]
    assert sum(r.walked for r in results) == 21
    assert sum(r.added for r in results) == 20
    assert indexed.index.usage().chunks == 21
    os.remove(indexed.path_of(CHUNKS[0].key))  # behind the index's back
    assert sum(i.reconcile(shard=(n, 3)).removed for n, i in enumerate(shards) if i) == 1
    assert indexed.index.usage().chunks == 20


def test_shard_names() -> None:
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "-1/2", "x", "1/0", "0/300"):
        with pytest.raises(ConfigError):
            parse_shard(bad)
    assert shard_of("0011223344556677/ab/cd/abcd.kvc", 4) == 0xAB % 4


def test_store_keeps_serving_while_the_index_is_down(
    tmp_path: Path, private_redis: Callable[[], subprocess.Popen[bytes]]
) -> None:
    server = private_redis()
    url = f"redis://127.0.0.1:{private_redis.port}/0"  # type: ignore[attr-defined]
    cap = 5 * SIZE
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=cap, index=url)
    index = store.index
    assert index is not None
    for chunk in CHUNKS[:5]:
        store.put(chunk.key, chunk.data)
    server.kill()
    server.wait()
    for chunk in CHUNKS[5:12]:  # every write succeeds, none is evicted
        assert store.put(chunk.key, chunk.data)
    assert all(store.get(c.key) is not None for c in CHUNKS[:12])
    assert index.errors > 0 and disk_usage(store)[1] == 12
    private_redis()  # back, empty
    index._down_until = 0.0  # the retry wait, not the subject here
    store.put(CHUNKS[12].key, CHUNKS[12].data)
    assert index.stale()
    index.reconcile()
    assert not index.stale()
    index.evict()
    used, count = disk_usage(store)
    assert used <= cap and index.usage().bytes == used


class TestIndexedJuiceFsStore(StoreSuite):
    """The indexed store through the two mounts of one JuiceFS volume, in turn."""

    replace_may_miss = True  # a read racing a rename over the file may find no file

    @pytest.fixture
    def make_store(self, juicefs: JuiceFsVolume, redis_url: str) -> Callable[[], FsStore]:
        place = juicefs.fresh("indexed")
        return lambda: FsStore(
            str(juicefs.alternate(place) / "cache"),
            create=True,
            access_resolution=0,
            index=redis_url,
        )


class TestIndexedS3StoreOnSeaweedFS(StoreSuite):
    time_resolution = 1.05

    @pytest.fixture
    def make_store(self, seaweedfs_s3: S3Service, redis_url: str) -> Callable[[], object]:
        pytest.importorskip("s3fs")
        from chunkstore.backends._s3 import S3Store

        bucket = seaweedfs_s3.new_bucket()
        return lambda: S3Store(
            bucket,
            "indexed",
            endpoint_url=seaweedfs_s3.endpoint,
            access_resolution=0,
            backoff=0.001,
            index=redis_url,
        )


def test_two_nodes_hold_one_cap_and_read_whole_chunks(
    juicefs: JuiceFsVolume, redis_url: str
) -> None:
    """A capped writer on each mount and a reader on each: the cap holds for both nodes
    together, and every read is the whole chunk or a miss."""
    places = juicefs.fresh("twonodes")
    FsStore(str(places[0] / "cache"), create=True)
    juicefs.settle()
    cap = 10 * SIZE
    stores = [
        FsStore(str(place / "cache"), max_bytes=cap, access_resolution=0, index=redis_url)
        for place in places
    ]
    halves = [CHUNKS[0::2], CHUNKS[1::2]]
    wrong: list[str] = []
    done = threading.Event()

    def write(side: int) -> None:
        for chunk in halves[side]:
            stores[side].put(chunk.key, chunk.data)

    def read(side: int) -> None:
        reader = FsStore(str(places[side] / "cache"), track_access=False)
        while not done.is_set():
            for chunk in halves[1 - side]:
                got = reader.get(chunk.key)
                if got is not None and bytes(got) != chunk.data:
                    wrong.append(chunk.key.hex)

    readers = [threading.Thread(target=read, args=(side,)) for side in (0, 1)]
    writers = [threading.Thread(target=write, args=(side,)) for side in (0, 1)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join(timeout=300)
    done.set()
    for thread in readers:
        thread.join(timeout=60)
    juicefs.settle()
    index = stores[0].index
    assert index is not None and not wrong
    used, count = disk_usage(stores[1])
    assert used <= cap and index.usage().bytes == used
    assert all(s.corrupt_detected == 0 for s in stores)


_PRUNER = """
import sys
from chunkstore.backends import _index
from chunkstore.backends._fs import FsStore
store = FsStore(sys.argv[1], index=sys.argv[2])
print("ready", flush=True)
store.index.evict(max_bytes=0)
"""


def test_a_pruner_killed_mid_eviction_is_repaired_by_reconcile(
    tmp_path: Path, redis_url: str
) -> None:
    root = str(tmp_path / "s")
    store = FsStore(root, create=True, index=redis_url)
    for chunk in CHUNKS:
        store.put(chunk.key, chunk.data)
    pruner = subprocess.Popen(
        [sys.executable, "-c", _PRUNER, root, redis_url],
        stdout=subprocess.PIPE,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    assert pruner.stdout is not None and pruner.stdout.readline().startswith(b"ready")
    time.sleep(0.02)
    os.kill(pruner.pid, signal.SIGKILL)
    pruner.wait(timeout=30)
    index = store.index
    assert index is not None
    index.reconcile()
    used, count = disk_usage(store)
    assert (index.usage().bytes, index.usage().chunks) == (used, count)


# --- batched round trips: reconcile in batches, the accounting thread's pipelines --------


def _aged(store: FsStore, chunks: list[MadeChunk], age: float = 1000.0) -> None:
    """Give the files of ``chunks`` an old last use, so a writer's use is told apart."""
    stamp = time.time() - age
    for chunk in chunks:
        os.utime(store.path_of(chunk.key), (stamp, stamp))


def _counted_calls(index: object, attr: str) -> list[int]:
    """Wrap the script ``attr`` of ``index`` so that each call is recorded (by args)."""
    script = getattr(index, attr)
    calls: list[int] = []

    def counted(keys: object, args: list[object], client: object = None) -> object:
        calls.append(len(args))
        return script(keys, args)

    setattr(index, attr, counted)
    return calls


def test_reconcile_in_batches_leaves_entries_a_writer_made_meanwhile_alone(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_index, "BATCH", 4)
    root = str(tmp_path / "s")
    plain = FsStore(root, create=True)
    plain.put_many([(c.key, c.data) for c in CHUNKS[:10]])  # unindexed
    _aged(plain, CHUNKS[:10])
    index = FsStore(root, index=redis_url).index
    writer = FsStore(root, access_resolution=0, index=redis_url)
    assert index is not None and writer.index is not None
    walk = list(index._scan(None))
    by_path = {plain.path_of(c.key): c for c in CHUNKS[:10]}
    rewritten = by_path[walk[4][0]]  # in the second batch, walked but not yet sent
    adds = _counted_calls(index, "_add_found")

    def scan(shard: object) -> Iterator[tuple[str, int, float, bool]]:
        for i, found in enumerate(walk):
            if i == 6:  # the first batch is in; a writer writes meanwhile
                writer.put(rewritten.key, rewritten.data)
                writer.put(CHUNKS[10].key, CHUNKS[10].data)  # not walked at all
                writer.index.flush()
            yield found

    index._scan = scan
    result = index.reconcile()
    assert adds == [16, 16, 8]  # three batches of (name, size, last use, has a record)
    assert (result.walked, result.added, result.removed) == (10, 9, 0)
    used, count = disk_usage(plain)
    assert count == 11 and (index.usage().bytes, index.usage().chunks) == (used, count)
    lru = index.client.zrange(index._keys[1], 0, -1, withscores=True)
    scores = {name.decode(): score for name, score in lru}
    assert len(scores) == 11
    name = writer._name_of(writer.path_of(rewritten.key))
    assert scores[name] > time.time() - 500  # the writer's use, not the walk's old one


def test_reconcile_takes_out_missing_files_across_batches(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_index, "BATCH", 4)
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    store.put_many([(c.key, c.data) for c in CHUNKS[:20]])
    index = store.index
    assert index is not None
    for chunk in CHUNKS[:10]:
        os.remove(store.path_of(chunk.key))  # behind the index's back
    removes = _counted_calls(index, "_remove_gone")
    result = index.reconcile()
    assert (result.walked, result.added, result.removed) == (10, 0, 10)
    assert removes == [5, 5, 3]  # the oldest reservation kept, then 4, 4 and 2 names
    assert {i.key for i in store.list()} == {c.key for c in CHUNKS[10:20]}
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)


@pytest.mark.parametrize("where", ["walk", "removal"])
def test_an_index_going_down_mid_reconcile_raises_and_stays_stale(
    tmp_path: Path,
    private_redis: Callable[[], subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    monkeypatch.setattr(_index, "BATCH", 4)
    server = private_redis()
    url = f"redis://127.0.0.1:{private_redis.port}/0"  # type: ignore[attr-defined]
    store = FsStore(str(tmp_path / "s"), create=True, index=url)
    store.put_many([(c.key, c.data) for c in CHUNKS[:12]])
    index = store.index
    assert index is not None
    for chunk in CHUNKS[:3]:
        os.remove(store.path_of(chunk.key))
    walk = list(index._scan(None))
    exists = index._exists

    def kill() -> None:
        if server.poll() is None:
            server.kill()
            server.wait()

    def scan(shard: object) -> Iterator[tuple[str, int, float]]:
        for i, found in enumerate(walk):
            if i == 5:
                kill()
            yield found

    def exists_then_die(path: str) -> bool:
        kill()
        return exists(path)

    if where == "walk":
        index._scan = scan
    else:
        index._exists = exists_then_die
    with pytest.raises(ConnectionError):
        index.reconcile()
    private_redis()  # back, empty
    index._down_until = 0.0  # the retry wait, not the subject here
    assert index.stale()
    index._scan, index._exists = (lambda shard: iter(walk)), exists
    index.reconcile(shard=(0, 1))
    assert index.stale()  # only a full reconcile clears it
    index.reconcile()
    assert not index.stale()
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)


class _Gate:
    """Holds the index's accounting thread in its next pipeline until opened; records how
    many requests each pipeline sent."""

    def __init__(self, index: object) -> None:
        self.sent: list[int] = []
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.thread: threading.Thread | None = None
        self._armed = False
        pipelined = index._pipelined  # type: ignore[attr-defined]

        def held(requests: list[tuple[object, ...]]) -> list[object]:
            self.thread = threading.current_thread()
            if self._armed:
                self._armed = False
                self.entered.set()
                assert self.opened.wait(30)
            self.sent.append(len(requests))
            return pipelined(requests)  # type: ignore[no-any-return]

        index._pipelined = held  # type: ignore[attr-defined]

    def arm(self) -> None:
        self.entered.clear()
        self.opened.clear()
        self._armed = True

    def wait_entered(self) -> None:
        assert self.entered.wait(30)


def _wait_queued(index: object, count: int) -> None:
    for _ in range(3000):
        if len(index._queued) >= count:  # type: ignore[attr-defined]
            return
        time.sleep(0.01)
    raise AssertionError(f"fewer than {count} requests queued")


def test_queued_touches_and_reservations_go_in_one_pipeline_in_order(
    tmp_path: Path, redis_url: str
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, access_resolution=0, index=redis_url)
    index = store.index
    assert index is not None
    for chunk in CHUNKS[:4]:  # LRU order A < B < C < D
        store.put(chunk.key, chunk.data)
    index.flush()
    gate = _Gate(index)
    a, b, c, d = (store.path_of(chunk.key) for chunk in CHUNKS[:4])
    gate.arm()
    index.touch([c])
    gate.wait_entered()  # the thread holds C's touch; what follows queues up behind it
    index.touch([b])
    time.sleep(0.002)
    index.touch([a])
    writer = threading.Thread(target=store.put, args=(CHUNKS[4].key, CHUNKS[4].data))
    # Uncapped, it reserves nothing: its chunk is counted once published, and that queues
    # behind the touches too.
    writer.start()
    _wait_queued(index, 3)
    gate.opened.set()
    writer.join(timeout=60)
    index.flush()
    assert gate.sent[:2] == [1, 3]  # B's and A's touches and E's account: one pipeline
    order = [name.decode() for name in index.client.zrange(index._keys[1], 0, -1)]
    names = [store._name_of(p) for p in (d, c, b, a, store.path_of(CHUNKS[4].key))]
    assert order == names
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)


def test_puts_waiting_together_share_one_credit_request(tmp_path: Path, redis_url: str) -> None:
    cap = 4 * SIZE  # so small that one credit is one chunk's room
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=cap, index=redis_url)
    index = store.index
    assert index is not None
    for chunk in CHUNKS[:4]:
        store.put(chunk.key, chunk.data)
        time.sleep(0.002)
    index.flush()
    gate = _Gate(index)
    gate.arm()
    index.touch([store.path_of(CHUNKS[3].key)])
    gate.wait_entered()
    writers = [
        threading.Thread(target=store.put, args=(chunk.key, chunk.data)) for chunk in CHUNKS[4:7]
    ]
    for thread in writers:
        thread.start()
    for _ in range(3000):
        if len(index._waiting) == 3:
            break
        time.sleep(0.01)
    assert len(index._waiting) == 3
    gate.opened.set()
    for thread in writers:
        thread.join(timeout=60)
    index.flush()
    assert gate.sent[1] == 1  # one credit request, room for all three
    assert {i.key for i in store.list()} == {c.key for c in (CHUNKS[3], *CHUNKS[4:7])}
    assert index.evicted == 3
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)
    assert disk_usage(store)[0] == cap


def _capped_with_delay(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, delay: float
) -> tuple[FsStore, _index.CapacityIndex]:
    """A store capped at 3 chunks whose index holds unwaited requests ``delay`` seconds."""
    monkeypatch.setattr(_index, "SEND_DELAY", delay)
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=3 * SIZE, index=redis_url)
    assert store.index is not None
    return store, store.index


def test_a_writers_commit_goes_with_its_next_reservation(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No delay runs out in this test: a commit waits for the next reservation, or the flush.
    store, index = _capped_with_delay(tmp_path, redis_url, monkeypatch, 600.0)
    gate = _Gate(index)
    for chunk in CHUNKS[:6]:
        store.put(chunk.key, chunk.data)
    index.flush()
    # The first reservation alone; then each commit with the next reservation; the last
    # commit with the flush (which sends nothing of its own).
    assert gate.sent == [1, 2, 2, 2, 2, 2, 1]
    assert index.evicted == 3
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)
    order = [name.decode() for name in index.client.zrange(index._keys[1], 0, -1)]
    assert order == [store._name_of(store.path_of(c.key)) for c in CHUNKS[3:6]]
    store.close()


def test_a_commit_no_reservation_follows_is_sent_after_the_delay(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, index = _capped_with_delay(tmp_path, redis_url, monkeypatch, 0.05)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    name = store._name_of(store.path_of(CHUNKS[0].key))
    for _ in range(3000):  # nothing else is queued: the delay alone sends it
        if index.client.zscore(index._keys[1], name) is not None:
            break
        time.sleep(0.01)
    assert index.client.zscore(index._keys[1], name) is not None
    assert index.client.zscore(index._keys[3], name) is None  # no longer reserved
    store.close()


def test_a_few_accounts_wait_for_more_and_go_in_one_round_trip(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past SEND_DELAY an account waits, up to SEND_DELAY_MOST (here never), for SEND_MIN.
    monkeypatch.setattr(_index, "SEND_DELAY", 0.01)
    monkeypatch.setattr(_index, "SEND_DELAY_MOST", 600.0)
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    index = store.index
    assert index is not None
    gate = _Gate(index)
    chunks = CHUNKS[: _index.SEND_MIN]
    store.put(chunks[0].key, chunks[0].data)
    time.sleep(0.2)  # twenty times SEND_DELAY
    assert gate.sent == []
    for chunk in chunks[1:]:
        store.put(chunk.key, chunk.data)
    names = [store._name_of(store.path_of(c.key)) for c in chunks]
    for _ in range(3000):
        if None not in index.client.zmscore(index._keys[1], names):
            break
        time.sleep(0.01)
    assert None not in index.client.zmscore(index._keys[1], names)
    assert gate.sent == [1]  # one account script for all of them
    store.close()


@pytest.mark.parametrize("ending", ["flush", "close"])
def test_flush_and_close_wait_for_everything_queued(
    tmp_path: Path, redis_url: str, ending: str
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, access_resolution=0, index=redis_url)
    index = store.index
    assert index is not None
    store.put_many([(c.key, c.data) for c in CHUNKS[:3]])
    index.flush()
    gate = _Gate(index)
    paths = [store.path_of(c.key) for c in CHUNKS[:3]]
    before = time.time()  # after the puts' commits: a score this late is a touch's
    gate.arm()
    index.touch(paths[:1])
    gate.wait_entered()
    index.touch(paths[1:])
    ender = threading.Thread(target=getattr(index, ending))
    ender.start()
    ender.join(timeout=0.05)
    assert ender.is_alive()  # it cannot end while the gate holds the thread
    gate.opened.set()
    ender.join(timeout=60)
    assert not ender.is_alive()
    scores = index.client.zmscore(index._keys[1], [store._name_of(p) for p in paths])
    assert all(score is not None and score >= before for score in scores)
    assert gate.sent == [1, 1]  # the two queued touches: one request, one pipeline
    if ending == "close":
        assert gate.thread is not None and not gate.thread.is_alive()
        assert index._behind is None
        store.put(CHUNKS[3].key, CHUNKS[3].data)  # a later write starts the thread anew
        index.close()
        assert index.usage().chunks == 4


def test_accounting_reloads_scripts_a_server_has_forgotten(tmp_path: Path, redis_url: str) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=3 * SIZE, index=redis_url)
    index = store.index
    assert index is not None
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    index.client.script_flush()
    for chunk in CHUNKS[1:5]:
        store.put(chunk.key, chunk.data)
    index.flush()
    assert index.errors == 0
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store) == (3 * SIZE, 3)


def test_a_full_reconcile_keeps_a_stale_mark_set_while_it_walked(
    tmp_path: Path, redis_url: str
) -> None:
    root = str(tmp_path / "s")
    FsStore(root, create=True).put_many([(c.key, c.data) for c in CHUNKS[:6]])
    index = FsStore(root, index=redis_url).index
    other = FsStore(root, index=redis_url).index
    assert index is not None and other is not None
    other._missed = True  # it wrote without the index; it marks it when it answers again
    assert other.stale()
    walk = list(index._scan(None))

    def scan(shard: object) -> Iterator[tuple[str, int, float]]:
        for i, found in enumerate(walk):
            if i == 3:  # a writer comes back from an outage while the walk runs
                other._missed = True
                assert other.stale()
            yield found

    index._scan = scan
    index.reconcile()
    assert index.stale()  # the writes of the outage may lie in walked directories
    index._scan = lambda shard: iter(walk)
    index.reconcile()
    assert not index.stale()


# --- eviction deletes slow victims several at a time -------------------------------------


def test_fast_deletes_run_one_by_one_in_the_evicting_thread(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every delete here counts as quick, however a loaded machine schedules this thread
    monkeypatch.setattr(_index, "SLOW_DELETE", 60.0)
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    store.put_many([(c.key, c.data) for c in CHUNKS[:20]])
    _aged(store, CHUNKS[:20])
    index = store.index
    assert index is not None
    index.reconcile()
    evict = index._evict
    threads: list[int] = []

    def fast(path: str, chosen_at: float, recorded: bool) -> tuple[bool, int]:
        threads.append(threading.get_ident())
        return evict(path, chosen_at, recorded)

    index._evict = fast
    assert index.evict(max_bytes=5 * SIZE) == 15
    assert threads == [threading.get_ident()] * 15  # a local unlink: no hop to a worker
    assert index._deleters is None
    assert disk_usage(store) == (5 * SIZE, 5)


def test_an_eviction_deletes_slow_victims_several_at_a_time(tmp_path: Path, redis_url: str) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    store.put_many([(c.key, c.data) for c in CHUNKS[:20]])
    _aged(store, CHUNKS[:20])
    index = store.index
    assert index is not None
    index.reconcile()  # the files' (old, distinct) times as the LRU order
    evict = index._evict
    lock = threading.Lock()
    running = [0, 0, 0]  # now, most at once, calls
    both = threading.Barrier(2, timeout=30)

    def slow(path: str, chosen_at: float, recorded: bool) -> tuple[bool, int]:
        with lock:
            running[0] += 1
            running[1] = max(running[:2])
            running[2] += 1
            first = running[2] <= 3
        if running[2] == 1:
            time.sleep(_index.SLOW_DELETE * 5)  # as slow as a network filesystem's delete
        elif first:
            both.wait()  # the next two deletes meet: they run at once
        try:
            return evict(path, chosen_at, recorded)
        finally:
            with lock:
                running[0] -= 1

    index._evict = slow
    assert index.evict(max_bytes=5 * SIZE) == 15
    assert 2 <= running[1] <= _index.EVICT_WORKERS
    assert index.evicted == 15
    assert disk_usage(store) == (5 * SIZE, 5)
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)


def test_a_victim_that_cannot_be_deleted_is_logged_and_counted_back_by_reconcile(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    store.put_many([(c.key, c.data) for c in CHUNKS[:10]])
    index = store.index
    assert index is not None
    stuck = store.path_of(CHUNKS[3].key)
    evict = index._evict

    def refusing(path: str, chosen_at: float, recorded: bool) -> tuple[bool, int]:
        if path == stuck:
            raise PermissionError(13, "Permission denied", path)
        return evict(path, chosen_at, recorded)

    index._evict = refusing
    with caplog.at_level("WARNING", logger=_index.__name__):
        assert index.evict(max_bytes=0) == 9
    assert "cannot evict" in caplog.text and CHUNKS[3].key.hex in caplog.text
    assert [i.key for i in store.list()] == [CHUNKS[3].key]  # on disk, out of the index
    assert index.usage().chunks == 0
    assert index.reconcile().added == 1
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)


def _changing_first_victim(index: _index.CapacityIndex, change: Callable[[str], None]) -> list[str]:
    """Wrap ``index``'s victim delete so that ``change(path)`` runs on the first victim
    after the index chose it, before the delete looks at it; returns the paths changed."""
    evict = index._evict
    changed: list[str] = []
    lock = threading.Lock()

    def changing(path: str, chosen_at: float, recorded: bool) -> tuple[bool, int]:
        with lock:
            first = not changed
            if first:
                changed.append(path)
        if first:
            time.sleep(0.01)  # past a coarse ctime clock's tick after the choice
            change(path)
        return evict(path, chosen_at, recorded)

    index._evict = changing
    return changed


def test_a_victim_a_put_replaced_after_the_choice_stays_and_is_counted_again(
    tmp_path: Path, redis_url: str
) -> None:
    _replaced_victim_stays(str(tmp_path / "s"), redis_url)


def test_a_victim_replaced_through_the_same_juicefs_mount_stays(
    juicefs: JuiceFsVolume, redis_url: str
) -> None:
    # Through the other mount the change shows once the attribute cache expires (docs).
    _replaced_victim_stays(str(juicefs.fresh("victim")[0] / "s"), redis_url)


def _ten_aged(store: FsStore) -> tuple[_index.CapacityIndex, dict[str, MadeChunk]]:
    """Ten chunks put into ``store`` and aged, its index reconciled from them; the index,
    and the chunks by path."""
    store.put_many([(c.key, c.data) for c in CHUNKS[:10]])
    _aged(store, CHUNKS[:10])
    index = store.index
    assert index is not None
    index.reconcile()
    return index, {store.path_of(c.key): c for c in CHUNKS[:10]}


def _replaced_victim_stays(root: str, redis_url: str) -> None:
    store = FsStore(root, create=True, index=redis_url)
    index, by_path = _ten_aged(store)
    changed = _changing_first_victim(
        index, lambda path: store.put_many([(by_path[path].key, by_path[path].data)])
    )
    assert index.evict(max_bytes=0) == 9
    assert (index.evicted, index.kept) == (9, 1)
    assert [store.path_of(i.key) for i in store.list()] == changed  # the new file stays
    assert store.get(by_path[changed[0]].key) == by_path[changed[0]].data
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store) == (SIZE, 1)


def test_a_victim_read_after_the_choice_stays(tmp_path: Path, redis_url: str) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url, access_resolution=0)
    index, by_path = _ten_aged(store)
    changed = _changing_first_victim(index, lambda path: store.get(by_path[path].key))
    assert index.evict(max_bytes=0) == 9
    assert index.kept == 1 and [store.path_of(i.key) for i in store.list()] == changed
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)


def test_a_capped_writer_keeps_a_victim_replaced_after_its_credit_chose_it(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, index = _credited_store(tmp_path, redis_url, monkeypatch)
    store.put_many([(c.key, c.data) for c in CHUNKS[:40]])
    index.flush()
    by_path = {store.path_of(c.key): c for c in CHUNKS[:40]}
    other = FsStore(str(tmp_path / "s"), index=redis_url)  # another writer, uncapped
    changed = _changing_first_victim(
        index, lambda path: other.put_many([(by_path[path].key, by_path[path].data)])
    )
    store.put_many([(c.key, c.data) for c in sample_chunks(8, seed=6)])
    index.flush()
    assert other.index is not None
    other.index.flush()
    index.flush()  # the kept victim's account, and the victim it chose in turn
    assert index.kept == 1 and os.path.exists(changed[0])
    on_disk = disk_usage(store)
    assert on_disk[0] <= 40 * SIZE
    usage = index.usage()
    assert usage.bytes + int(store.index.client.hget(index._keys[0], "credit") or 0) <= 40 * SIZE
    assert (usage.bytes, usage.chunks) == on_disk


def test_a_ctime_clock_ahead_of_the_writers_spares_each_victim_once_and_the_cap_holds(
    tmp_path: Path, redis_url: str
) -> None:
    """Where files are stamped by a clock a minute ahead (another machine's), every victim
    looks changed after the choice. Each is left in place once and deleted when chosen
    again, so eviction ends, and the files come back under the cap."""
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=10 * SIZE, index=redis_url)
    index = store.index
    assert index is not None
    evict = index._evict
    index._evict = lambda path, chosen_at, recorded: evict(path, chosen_at - 60.0, recorded)
    chunks = sample_chunks(30, seed=12)
    for chunk in chunks:
        store.put_many([(chunk.key, chunk.data)])
    index.flush()
    kept = index.kept
    assert 0 < kept <= len(chunks)  # each victim spared once at most
    time.sleep(0.5)
    assert index.kept == kept  # nothing goes on accounting and sparing by itself
    on_disk = disk_usage(store)
    assert on_disk[0] <= 10 * SIZE
    usage = index.usage()
    assert (usage.bytes, usage.chunks) == on_disk
    store.close()


def test_past_max_spared_victims_are_deleted_whatever_their_ctime(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_index, "MAX_SPARED", 2)
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=4 * SIZE, index=redis_url)
    index = store.index
    assert index is not None
    evict = index._evict
    index._evict = lambda path, chosen_at, recorded: evict(path, chosen_at - 60.0, recorded)
    for chunk in sample_chunks(12, seed=13):
        store.put_many([(chunk.key, chunk.data)])
    index.flush()
    assert index.kept == 2
    assert disk_usage(store)[0] <= 4 * SIZE
    store.close()


# --- reconcile and reservations whose files are not published yet ------------------------


def test_a_reconcile_keeps_a_reservation_whose_temp_file_is_being_written(
    tmp_path: Path, redis_url: str
) -> None:
    root = str(tmp_path / "s")
    writer = FsStore(root, create=True, max_bytes=40 * SIZE, index=redis_url)  # reserves
    writer.put_many([(c.key, c.data) for c in CHUNKS[:3]])
    other = FsStore(root, index=redis_url).index  # another machine's reconcile
    assert writer.index is not None and other is not None
    results = []
    write_temp = writer._write_temp

    def writing(key: object, view: memoryview, directory: str) -> str:
        results.append(other.reconcile())  # the entry is reserved, its file not there yet
        return write_temp(key, view, directory)  # type: ignore[arg-type]

    writer._write_temp = writing  # type: ignore[method-assign]
    writer.put(CHUNKS[3].key, CHUNKS[3].data)
    writer.index.flush()
    assert [(r.walked, r.added, r.removed) for r in results] == [(3, 0, 0)]
    assert (other.usage().bytes, other.usage().chunks) == disk_usage(writer) == (4 * SIZE, 4)
    name = writer._name_of(writer.path_of(CHUNKS[3].key))
    assert other.client.zscore(other._keys[1], name) is not None  # committed: in the LRU order
    assert other.client.zscore(other._keys[3], name) is None  # no longer reserved


def test_a_reconcile_takes_out_a_reservation_older_than_the_grace(
    tmp_path: Path, redis_url: str
) -> None:
    """One-chunk reservations, as writers of spec 6.8's earlier reading make them (counted,
    sized, in ``reserved``): a reconcile keeps a young one and takes out one past the grace."""
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=40 * SIZE, index=redis_url)
    index = store.index
    assert index is not None
    store.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    index.flush()
    dead, live = (index._name_of(store.path_of(c.key)) for c in CHUNKS[2:4])
    old = time.time() - _index.RESERVATION_GRACE - 1
    for name, when in ((dead, old), (live, time.time())):  # killed, or still writing
        index.client.hset(index._keys[2], name, SIZE)
        index.client.zadd(index._keys[3], {name: when})
        index.client.hincrby(index._keys[0], "bytes", SIZE)
        index.client.hincrby(index._keys[0], "chunks", 1)
    result = index.reconcile()
    assert (result.walked, result.added, result.removed) == (2, 0, 1)
    assert (index.usage().bytes, index.usage().chunks) == (3 * SIZE, 3)  # the live one counted
    assert index.client.zrange(index._keys[3], 0, -1) == [live.encode()]
    store.put(CHUNKS[3].key, CHUNKS[3].data)  # its chunk published after all: accounted
    index.flush()
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)
    assert index.client.zcard(index._keys[3]) == 0


def test_s3_put_many_accounts_its_batch_in_one_round_trip(
    s3_endpoint: str, s3_bucket: str, redis_url: str
) -> None:
    pytest.importorskip("s3fs")
    from chunkstore.backends._s3 import S3Store

    store = S3Store(
        s3_bucket,
        f"batched/{uuid.uuid4().hex[:8]}",
        endpoint_url=s3_endpoint,
        max_bytes=4 * SIZE,
        index=redis_url,
        backoff=0.001,
    )
    index = store.index
    assert index is not None
    pipelined = index._pipelined
    sent: list[list[str]] = []

    def counted(requests: list[tuple[object, ...]]) -> list[object]:
        sent.append([f"{r[0]} {len(r[1])}" for r in requests])  # type: ignore[arg-type]
        return pipelined(requests)

    index._pipelined = counted  # type: ignore[method-assign]
    assert store.put_many([(c.key, c.data) for c in CHUNKS[:10]]) == [True] * 10
    assert sent == [["accounts 10"]]  # one script call for the ten
    assert {info.key for info in store.list()} == {c.key for c in CHUNKS[6:10]}
    assert (index.usage().bytes, index.usage().chunks) == (4 * SIZE, 4)
    assert index.evicted == 6
    assert store.put_if_absent_many([(c.key, c.data) for c in CHUNKS[8:12]]) == [
        False,
        False,
        True,
        True,
    ]
    assert sent[1:] == [["accounts 2"]]  # only the two it wrote
    assert {info.key for info in store.list()} == {c.key for c in CHUNKS[8:12]}
    assert (index.usage().bytes, index.usage().chunks) == (4 * SIZE, 4)


def _s3_server(request: pytest.FixtureRequest, server: str) -> tuple[str, str]:
    """The endpoint and a bucket of ``server``: moto's, or a fresh one on SeaweedFS."""
    if server == "moto":
        return request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
    service = request.getfixturevalue("seaweedfs_s3")
    return service.endpoint, service.new_bucket()


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_s3_victims_go_in_batched_deletes_with_their_access_records(
    request: pytest.FixtureRequest, server: str, redis_url: str
) -> None:
    """An eviction on S3 deletes its victims and their access records in DeleteObjects
    requests, with no HEAD of each (one more trip to the index asks which it took in
    again)."""
    pytest.importorskip("s3fs")
    from chunkstore.backends._s3 import S3Store

    endpoint, bucket = _s3_server(request, server)
    store = S3Store(
        bucket,
        f"evict/{uuid.uuid4().hex[:8]}",
        endpoint_url=endpoint,
        index=redis_url,
        access_resolution=0,
        backoff=0.001,
    )
    index = store.index
    assert index is not None
    store.put_many([(c.key, c.data) for c in CHUNKS[:10]])
    assert [store.get(c.key) is not None for c in CHUNKS[:10]] == [True] * 10  # access records
    store.flush()
    index.flush()

    def access_records() -> list[str]:
        listed = store._run(lambda: store._request("list_objects_v2", Prefix=store._full("")))
        return [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith(".atime")]

    assert len(access_records()) == 10
    ops: list[str] = []
    real = store._request

    async def recorded(op: str, **kwargs: object) -> object:
        ops.append(op)
        return await real(op, **kwargs)

    store._request = recorded  # type: ignore[method-assign]
    assert index.evict(max_bytes=3 * SIZE) == 7
    assert ops == ["delete_objects"]
    store._request = real  # type: ignore[method-assign]
    assert (index.usage().bytes, index.usage().chunks) == (3 * SIZE, 3)
    names = {info.key for info in store.list()}
    assert len(names) == 3
    assert len(access_records()) == 3  # the victims' went with them
    store.close()


@pytest.mark.parametrize("server", ["moto", "seaweedfs"])
def test_an_s3_victim_stored_again_after_the_choice_stays_and_stays_counted(
    request: pytest.FixtureRequest, server: str, redis_url: str
) -> None:
    """S3 has no ctime to compare, so the index is asked instead: a victim a writer stored
    again (and accounted) between the choice and the delete stays, in the store and in the
    index."""
    pytest.importorskip("s3fs")
    from chunkstore.backends._s3 import S3Store

    endpoint, bucket = _s3_server(request, server)
    prefix = f"again/{uuid.uuid4().hex[:8]}"
    _stored_again_stays(S3Store(bucket, prefix, endpoint_url=endpoint, index=redis_url))


def test_a_victim_stored_again_through_fsspec_stays_and_stays_counted(redis_url: str) -> None:
    """fsspec reports no ctime either: the same check as on S3."""
    fsspec = pytest.importorskip("fsspec")
    root = f"/again-{uuid.uuid4().hex}"
    _stored_again_stays(FsStore(root, fs=fsspec.filesystem("memory"), create=True, index=redis_url))


def _stored_again_stays(store: Any) -> None:
    """Ten chunks in ``store``; another writer stores the first victim again after the index
    chose it, and accounts it before the delete: it stays, the other nine go, and the index
    counts it."""
    index = store.index
    assert index is not None
    store.put_many([(c.key, c.data) for c in CHUNKS[:10]])
    index.flush()
    by_name = {index._name_of(store._chunk_path(c.key)): c for c in CHUNKS[:10]}
    still_out = index._still_out
    again: list[MadeChunk] = []

    def storing_the_first_again(
        names: list[str], recorded: list[bool]
    ) -> tuple[list[str], list[bool]]:
        if not again:
            again.append(by_name[names[0]])
            assert store.put_many([(again[0].key, again[0].data)]) == [True]
            index.flush()  # its account, sent after the fact on a filesystem, is in
        return still_out(names, recorded)

    index._still_out = storing_the_first_again
    assert index.evict(max_bytes=0) == 9
    assert (index.evicted, index.kept) == (9, 1)
    assert [info.key for info in store.list()] == [again[0].key]
    assert store.get(again[0].key) == again[0].data
    assert (index.usage().bytes, index.usage().chunks) == (SIZE, 1)
    store.close()


def test_an_uncapped_writer_publishes_without_waiting_for_its_reservation(
    tmp_path: Path, redis_url: str
) -> None:
    """With no cap there is no room to make, so a put reserves nothing and waits for no
    round trip; the index counts the chunks after their publish, in order, in one call."""
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    index = store.index
    assert index is not None
    gate = _Gate(index)
    gate.arm()
    for chunk in CHUNKS[:3]:  # the accounting thread is held: none of this is sent yet
        assert store.put(chunk.key, chunk.data)
    gate.wait_entered()
    assert disk_usage(store) == (3 * SIZE, 3)
    gate.opened.set()
    index.flush()
    assert gate.sent == [1]  # one account for the three, and no reservation
    assert (index.usage().bytes, index.usage().chunks) == (3 * SIZE, 3)
    order = [name.decode() for name in index.client.zrange(index._keys[1], 0, -1)]
    assert order == [store._name_of(store.path_of(c.key)) for c in CHUNKS[:3]]
    assert index.client.zcard(index._keys[3]) == 0  # none left reserved
    store.close()


def _credit_counted(index: _index.CapacityIndex) -> tuple[int, int]:
    """The credit usage counts, and what the writers' credit adds up to; they must agree."""
    counted = int(index.client.hget(index._keys[0], "credit") or 0)
    held = sum(int(v) for v in index.client.hvals(index._credit_keys[6]))
    assert counted == held >= 0
    return counted, index.client.zcard(index._credit_keys[7])


def _credited_store(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[FsStore, _index.CapacityIndex]:
    """A store capped at 40 chunks whose writer asks for CREDIT_CHUNKS' room at a time."""
    monkeypatch.setattr(_index, "CREDIT_SHARE", 1)
    monkeypatch.setattr(_index, "CREDIT_TOTAL_SHARE", 1)
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=40 * SIZE, index=redis_url)
    assert store.index is not None
    return store, store.index


def _requests_sent(index: _index.CapacityIndex) -> list[str]:
    sent: list[str] = []
    pipelined = index._pipelined

    def counted(requests: list[tuple[object, ...]]) -> list[object]:
        sent.extend(str(r[0]) for r in requests)
        return pipelined(requests)

    index._pipelined = counted  # type: ignore[method-assign]
    return sent


def test_a_capped_writer_reserves_room_for_many_chunks_in_one_request(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_index, "CREDIT_SHARE", 1)  # room for CREDIT_CHUNKS at a time
    monkeypatch.setattr(_index, "CREDIT_TOTAL_SHARE", 1)
    cap = 24 * SIZE
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=cap, index=redis_url)
    index = store.index
    assert index is not None
    sent = _requests_sent(index)
    for chunk in CHUNKS[:20]:
        assert store.put(chunk.key, chunk.data)
    index.flush()
    # the first put waits for credit; the next is asked for when half of it is drawn
    assert sent.count("credit") == 2
    assert sent.count("accounts") < 20
    used, count = disk_usage(store)
    credit, writers = _credit_counted(index)
    assert (credit, writers) == (2 * _index.CREDIT_CHUNKS * SIZE - 20 * SIZE, 1)
    assert used + credit <= cap  # the room held is counted: the files stay under the cap
    assert (index.usage().bytes, index.usage().chunks) == (used, count)
    assert index.evicted == 20 - count
    store.close()
    assert _credit_counted(index) == (0, 0)  # closing gives back what is left


def test_a_failed_write_gives_its_room_back_to_the_credit(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, index = _credited_store(tmp_path, redis_url, monkeypatch)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    held = index._credit

    def failing(key: object, view: memoryview, directory: str) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write_temp", failing)
    with pytest.raises(StoreError):
        store.put(CHUNKS[1].key, CHUNKS[1].data)
    assert index._credit == held
    index.flush()
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store) == (SIZE, 1)
    store.close()


def test_a_writer_not_seen_for_the_grace_loses_its_credit_to_the_next_request(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_index, "CREDIT_SHARE", 1)
    monkeypatch.setattr(_index, "CREDIT_TOTAL_SHARE", 1)
    cap = 40 * SIZE
    root = str(tmp_path / "s")
    idle = FsStore(root, create=True, max_bytes=cap, index=redis_url)
    busy = FsStore(root, max_bytes=cap, index=redis_url)
    assert idle.index is not None and busy.index is not None
    idle.put(CHUNKS[0].key, CHUNKS[0].data)
    idle.index.flush()
    assert idle.index._credit == (_index.CREDIT_CHUNKS - 1) * SIZE
    monkeypatch.setattr(_index, "CREDIT_GRACE", 0.2)
    time.sleep(0.3)  # by the server's clock, the idle writer looks dead
    busy.put(CHUNKS[1].key, CHUNKS[1].data)  # its credit request gives the idle one's back
    busy.index.flush()
    assert _credit_counted(busy.index) == ((_index.CREDIT_CHUNKS - 1) * SIZE, 1)
    # The idle writer comes back: it draws on credit it no longer holds, so its chunk is
    # counted in full, and it asks anew next time.
    idle.put(CHUNKS[2].key, CHUNKS[2].data)
    idle.index.flush()
    assert idle.index._credit == 0
    assert (busy.index.usage().bytes, busy.index.usage().chunks) == disk_usage(idle)
    assert _credit_counted(busy.index)[0] == (_index.CREDIT_CHUNKS - 1) * SIZE
    idle.put(CHUNKS[3].key, CHUNKS[3].data)
    idle.index.flush()
    assert _credit_counted(busy.index) == (2 * (_index.CREDIT_CHUNKS - 1) * SIZE, 2)
    for store in (idle, busy):
        store.close()
    assert _credit_counted(busy.index) == (0, 0)
    assert (busy.index.usage().bytes, busy.index.usage().chunks) == disk_usage(idle)


def test_writers_credit_together_stays_within_a_quarter_of_the_cap(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past a quarter of the cap held as credit, a writer gets only its next chunk's room: many
    writers on a small cap leave room for chunks."""
    monkeypatch.setattr(_index, "CREDIT_SHARE", 1)
    cap = 40 * SIZE
    root = str(tmp_path / "s")
    stores = [FsStore(root, create=True, max_bytes=cap, index=redis_url) for _ in range(4)]
    grants = []
    for store, chunk in zip(stores, CHUNKS):
        assert store.index is not None
        store.put(chunk.key, chunk.data)
        store.index.flush()
        grants.append(store.index._credit + SIZE)  # what it drew, and what is left
    assert grants == [10 * SIZE, SIZE, SIZE, SIZE]
    assert _credit_counted(stores[0].index)[0] == 9 * SIZE  # type: ignore[arg-type]
    # Writers that drew all their credit are given back too (nothing), once not seen.
    monkeypatch.setattr(_index, "CREDIT_GRACE", 0.0)
    stores[0].index.reconcile()  # type: ignore[union-attr]
    assert _credit_counted(stores[0].index) == (0, 0)  # type: ignore[arg-type]
    for store in stores:
        store.close()


def test_credit_lost_with_a_failed_request_is_given_back_before_the_next(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accounts that drew on credit fail while the index is down: the server still counts
    that credit. The writer gives it back before it asks anew, so it is not held twice."""
    store, index = _credited_store(tmp_path, redis_url, monkeypatch)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    index.flush()
    assert _credit_counted(index)[0] == index._credit > 0
    index._down_until = time.monotonic() + 600  # taken as down: nothing is sent
    for chunk in CHUNKS[1:4]:
        assert store.put(chunk.key, chunk.data)  # drawn on credit; their accounts fail
    index.flush()
    assert index._credit == 0 and index._forget
    index._down_until = 0.0
    store.put(CHUNKS[4].key, CHUNKS[4].data)
    index.flush()
    assert _credit_counted(index)[0] == index._credit  # the lost credit was given back
    assert not index._forget
    index.reconcile()  # the chunks accounted while it was down
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store)
    store.close()


def test_a_credit_with_too_few_victims_is_cut_to_what_is_needed(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 8 * SIZE
    root = str(tmp_path / "s")
    full = FsStore(root, create=True, max_bytes=cap, index=redis_url)
    full.put_many([(c.key, c.data) for c in CHUNKS[:8]])
    full.close()
    monkeypatch.setattr(_index, "CREDIT_SHARE", 2)  # asks for 4 chunks' room
    monkeypatch.setattr(_index, "CREDIT_TOTAL_SHARE", 1)
    monkeypatch.setattr(_index, "MAX_VICTIMS", 1)  # one victim a step: not enough for 4
    store = FsStore(root, max_bytes=cap, index=redis_url)
    assert store.index is not None
    store.put(CHUNKS[8].key, CHUNKS[8].data)
    store.index.flush()
    credit = _credit_counted(store.index)[0]
    assert disk_usage(store)[0] + credit <= cap  # the room counted is room that was made
    assert (store.index.usage().bytes, store.index.usage().chunks) == disk_usage(store)
    store.close()


def test_a_credit_request_that_cannot_be_queued_leaves_no_put_waiting(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=40 * SIZE, index=redis_url)
    index = store.index
    assert index is not None
    queue = index._queue

    def refused(*request: object) -> None:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(index, "_queue", refused)
    with pytest.raises(RuntimeError):
        index.reserve(store.path_of(CHUNKS[0].key), SIZE)
    assert not index._waiting and not index._asking
    monkeypatch.setattr(index, "_queue", queue)
    assert store.put(CHUNKS[1].key, CHUNKS[1].data)  # asks anew, and is not left waiting
    index.flush()
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store) == (SIZE, 1)
    store.close()


def test_a_bug_in_the_accounting_thread_fails_the_put_waiting_for_credit(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes=40 * SIZE, index=redis_url)
    index = store.index
    assert index is not None
    pipelined = index._pipelined

    def broken(requests: list[tuple[object, ...]]) -> list[object]:
        raise ValueError("a bug")

    monkeypatch.setattr(index, "_pipelined", broken)
    with pytest.raises(ValueError, match="a bug"):  # raised to the put, not left waiting
        store.put(CHUNKS[0].key, CHUNKS[0].data)
    assert not index._waiting and not index._asking
    monkeypatch.setattr(index, "_pipelined", pipelined)
    assert store.put(CHUNKS[1].key, CHUNKS[1].data)
    index.flush()
    assert (index.usage().bytes, index.usage().chunks) == disk_usage(store) == (SIZE, 1)
    store.close()


def _removes_counted(store: FsStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every path ``store`` removes from now on (removing it still)."""
    removed: list[str] = []
    remove = store.io.remove

    def counted(path: str) -> bool:
        removed.append(path)
        return remove(path)

    monkeypatch.setattr(store.io, "remove", counted)
    return removed


def test_a_victim_with_no_access_record_known_costs_one_unlink(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    index, by_path = _ten_aged(store)
    removed = _removes_counted(store, monkeypatch)
    assert index.evict(max_bytes=0) == 10
    assert sorted(removed) == sorted(by_path)  # no unlink of an absent access record
    assert list(store.list()) == []
    store.close()


def test_an_access_record_a_reader_wrote_goes_with_its_victim(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url, access_resolution=0)
    index, by_path = _ten_aged(store)
    # (a filesystem that cannot set an access time: the reader writes a record beside it)
    monkeypatch.setattr(store.io, "set_access", lambda *_args: False)
    path = store.path_of(CHUNKS[0].key)
    assert store.get(CHUNKS[0].key) == CHUNKS[0].data
    index.flush()
    assert os.path.exists(path + ".atime")
    records = index._keys[5]
    assert index.client.smembers(records) == {store._name_of(path).encode()}
    removed = _removes_counted(store, monkeypatch)
    assert index.evict(max_bytes=0) == 10
    assert sorted(removed) == sorted([*by_path, path + ".atime"])
    assert not os.path.exists(path + ".atime") and index.client.scard(records) == 0
    store.close()


def test_a_record_the_index_does_not_know_of_is_left_and_does_no_harm(
    tmp_path: Path, redis_url: str
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    index, _ = _ten_aged(store)
    path = store.path_of(CHUNKS[0].key)
    with open(path + ".atime", "wb") as record:  # as a reader without the index writes one
        record.write(_layout.access_bytes(time.time() - 5000))
    assert index.evict(max_bytes=0) == 10
    assert os.path.exists(path + ".atime") and list(store.list()) == []
    store.put(CHUNKS[0].key, CHUNKS[0].data)  # stored again beside the leftover record
    assert store.get(CHUNKS[0].key) == CHUNKS[0].data
    [info] = store.list()
    os.remove(path + ".atime")
    [without] = store.list()
    assert info.key == CHUNKS[0].key and info.atime == without.atime  # the older record: no use
    store.close()


def test_a_reconcile_notes_the_records_it_finds_so_their_victims_take_them(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url)
    index, by_path = _ten_aged(store)
    recorded = [store.path_of(c.key) for c in CHUNKS[:2]]
    for path in recorded:  # as readers without the index (or before a restart) wrote them
        with open(path + ".atime", "wb") as record:
            record.write(_layout.access_bytes(time.time() - 5000))
    index.client.delete(index._keys[5])  # the set lost too (a Redis restarted empty)
    assert index.reconcile().added == 0  # every chunk was counted: only the records are new
    noted = {store._name_of(path).encode() for path in recorded}
    assert index.client.smembers(index._keys[5]) == noted
    removed = _removes_counted(store, monkeypatch)
    assert index.evict(max_bytes=0) == 10
    assert sorted(removed) == sorted([*by_path, *(path + ".atime" for path in recorded)])
    assert not any(os.path.exists(path + ".atime") for path in recorded)
    store.close()


def test_a_chunk_taken_out_of_the_index_drops_its_record_mark(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, index=redis_url, access_resolution=0)
    index, _ = _ten_aged(store)
    monkeypatch.setattr(store.io, "set_access", lambda *_args: False)
    assert store.get(CHUNKS[0].key) == CHUNKS[0].data
    index.flush()
    assert index.client.scard(index._keys[5]) == 1
    assert store.delete_many([CHUNKS[0].key]) == 1
    index.flush()
    assert index.client.scard(index._keys[5]) == 0
    store.close()
