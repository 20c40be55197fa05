"""Multi-process reliability of FsStore: kill -9 mid-write, racing writers/readers, the cap.

Deterministic in what they assert (invariants that hold at every interleaving)
and bounded in time (fixed rounds and counts); the interleavings themselves
vary from run to run.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.format import decode_chunk
from chunkstore.testing.factories import sample_chunks
from tests.backends import reliability_workers as workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ctx() -> multiprocessing.context.BaseContext:
    # forkserver: fast process starts without forking pytest's threads (moto, hypothesis)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.backends.reliability_workers"])
    return context


def test_kill_9_mid_write_leaves_no_partial_chunks(
    tmp_path: Path, ctx: multiprocessing.context.BaseContext
) -> None:
    root = str(tmp_path / "store")
    rng = random.Random(1234)
    kills = 0
    for round_ in range(10):
        counter = ctx.Value("l", 0)
        proc = ctx.Process(target=workers.endless_writer, args=(root, counter, round_))
        proc.start()
        deadline = time.monotonic() + 30
        while counter.value < 2 and time.monotonic() < deadline and proc.is_alive():
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.03))
        proc.kill()  # SIGKILL: no cleanup handlers run
        proc.join()
        kills += proc.exitcode == -9
    assert kills == 10
    store = FsStore(root)
    infos = list(store.list())
    assert infos, "the writers stored nothing"
    for info in infos:
        data = store.get(info.key)
        assert data is not None and len(data) == info.size
        decode_chunk(data, expected_key=info.key.digest)
    assert store.corrupt_detected == 0
    assert store.foreign_files() == []
    # interrupted writes are orphan temp files, swept once past the grace period
    orphans = store.orphans()
    assert all(Path(o.path).name.startswith(".") for o in orphans)
    assert store.remove_orphans(grace=0) == len(orphans)
    assert store.orphans() == []


def test_concurrent_writers_and_readers_never_tear(
    tmp_path: Path, ctx: multiprocessing.context.BaseContext
) -> None:
    root = str(tmp_path / "store")
    with ctx.Pool(4) as pool:
        results = pool.starmap(workers.mixed_worker, [(root, seed, 600) for seed in range(4)])
    assert sum(r["reads"] for r in results) > 400
    assert sum(r["hits"] for r in results) > 0
    assert [r["corrupt"] for r in results] == [0, 0, 0, 0]
    store = FsStore(root)
    for info in store.list():
        decode_chunk(store.get(info.key) or b"", expected_key=info.key.digest)
    assert store.orphans() == []


def test_capacity_cap_holds_under_concurrent_writers(
    tmp_path: Path, ctx: multiprocessing.context.BaseContext
) -> None:
    root = str(tmp_path / "store")
    size = len(sample_chunks(1)[0].data)
    cap = 10 * size
    FsStore(root, create=True, max_bytes=cap)
    with ctx.Pool(4) as pool:
        worst = pool.starmap(workers.capped_writer, [(root, 100 + s, cap, 30) for s in range(4)])
    assert max(worst) <= cap  # never above the cap at any point a writer looked
    store = FsStore(root, max_bytes=cap)
    chunks = list(store.list())
    assert sum(i.size for i in chunks) <= cap
    assert len(chunks) == 10  # 120 distinct chunks written, the cap keeps exactly ten
    assert store.usage().bytes == sum(i.size for i in chunks)
