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

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._index import parse_shard, shard_of
from chunkstore.errors import ConfigError
from chunkstore.testing.factories import MadeChunk, sample_chunks
from chunkstore.testing.store_suite import StoreSuite
from tests.services import (
    JuiceFsVolume,
    S3Service,
    find_binary,
    free_port,
    stop,
    unavailable,
    wait_for,
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
from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks
store = FsStore(sys.argv[1], create=True, max_bytes=int(sys.argv[3]), index=sys.argv[2])
print("ready", flush=True)
for chunk in sample_chunks(400, seed=int(sys.argv[4])):
    store.put(chunk.key, chunk.data)
"""


def test_writers_killed_at_any_point_are_repaired_by_reconcile(
    tmp_path: Path, redis_url: str
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
    store = FsStore(root, max_bytes=cap, index=redis_url)
    index = store.index
    assert index is not None
    result = index.reconcile()
    used, count = disk_usage(store)
    assert (index.usage().bytes, index.usage().chunks) == (used, count)
    assert result.walked == count
    index.evict()
    used, count = disk_usage(store)
    assert used <= cap and (index.usage().bytes, index.usage().chunks) == (used, count)


def test_sharded_reconciles_repair_everything(tmp_path: Path, redis_url: str) -> None:
    root = str(tmp_path / "s")
    FsStore(root, create=True).put_many([(c.key, c.data) for c in CHUNKS[:20]])  # unindexed
    indexed = FsStore(root, index=redis_url)
    assert indexed.index is not None
    indexed.put(CHUNKS[20].key, CHUNKS[20].data)
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


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start (and restart) a redis-server of this test's own on one loopback port."""
    binary = find_binary("redis-server")
    if binary is None:
        unavailable("redis-server is not installed", "apt-get install -y redis-server")
    port = free_port()
    running: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                str(tmp_path),
            ],
            stdout=subprocess.DEVNULL,
        )
        running.append(proc)
        import redis

        client = redis.Redis(port=port)
        wait_for(lambda: _pings(client), "redis-server", proc)
        return proc

    start.port = port  # type: ignore[attr-defined]
    yield start
    for proc in running:
        stop(proc)


def _pings(client: object) -> bool:
    try:
        return bool(client.ping())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not up yet
        return False


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
