"""Multi-process reliability of FsStore: kill -9 mid-write, racing writers/readers, the cap.

Deterministic in what they assert (invariants that hold at every interleaving)
and bounded in time (fixed rounds and counts); the interleavings themselves
vary from run to run. Each runs on a local directory and on a JuiceFS volume, where
the worker processes take its two mounts in turn (two nodes of one shared store).
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.format import decode_chunk
from chunkstore.testing.factories import sample_chunks
from tests.backends import reliability_workers as workers

pytestmark = pytest.mark.slow


@dataclass(frozen=True, slots=True)
class SharedRoot:
    """One store's root as each of two nodes opens it."""

    where: str
    """``local`` or ``juicefs``."""
    roots: tuple[str, str]
    """The root through each node's mount (the same path twice on a local disk)."""
    settle: Callable[[], None]
    """Wait until every node sees what each one did (a shared mount's caches)."""

    def of(self, worker: int) -> str:
        """The root worker ``worker`` opens: the nodes take turns."""
        return self.roots[worker % 2]


@pytest.fixture(params=["local", "juicefs"])
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> SharedRoot:
    if request.param == "local":
        root = str(tmp_path / "store")
        return SharedRoot("local", (root, root), lambda: None)
    volume = request.getfixturevalue("juicefs")
    first, second = (str(place / "store") for place in volume.fresh("reliability"))
    return SharedRoot("juicefs", (first, second), volume.settle)


@pytest.fixture(scope="module")
def ctx() -> multiprocessing.context.BaseContext:
    # forkserver: fast process starts without forking pytest's threads (moto, hypothesis)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.backends.reliability_workers"])
    return context


def test_kill_9_mid_write_leaves_no_partial_chunks(
    shared: SharedRoot, ctx: multiprocessing.context.BaseContext
) -> None:
    rng = random.Random(1234)
    kills = 0
    for round_ in range(10):
        counter = ctx.Value("l", 0)
        proc = ctx.Process(target=workers.endless_writer, args=(shared.of(round_), counter, round_))
        proc.start()
        deadline = time.monotonic() + 30
        while counter.value < 2 and time.monotonic() < deadline and proc.is_alive():
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.03))
        proc.kill()  # SIGKILL: no cleanup handlers run
        proc.join()
        kills += proc.exitcode == -9
    assert kills == 10
    shared.settle()
    store = FsStore(shared.of(0))
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
    shared: SharedRoot, ctx: multiprocessing.context.BaseContext
) -> None:
    jobs = [(shared.of(seed), seed, 600) for seed in range(4)]
    with ctx.Pool(4) as pool:
        results = pool.starmap(workers.mixed_worker, jobs)
    assert sum(r["reads"] for r in results) > 400
    assert sum(r["hits"] for r in results) > 0
    assert [r["corrupt"] for r in results] == [0, 0, 0, 0]
    shared.settle()
    store = FsStore(shared.of(1))
    for info in store.list():
        decode_chunk(store.get(info.key) or b"", expected_key=info.key.digest)
    assert store.orphans() == []


def test_capacity_cap_holds_under_concurrent_writers(
    shared: SharedRoot, ctx: multiprocessing.context.BaseContext
) -> None:
    size = len(sample_chunks(1)[0].data)
    cap = 10 * size
    FsStore(shared.of(0), create=True, max_bytes=cap)
    # JuiceFS's flock has a waiter poll for the lock: 4 x 30 contended puts took ~50 s there.
    puts = 30 if shared.where == "local" else 10
    jobs = [(shared.of(s), 100 + s, cap, puts) for s in range(4)]
    with ctx.Pool(4) as pool:
        worst = pool.starmap(workers.capped_writer, jobs)
    assert max(worst) <= cap  # never above the cap at any point a writer looked
    shared.settle()
    store = FsStore(shared.of(1), max_bytes=cap)
    chunks = list(store.list())
    assert sum(i.size for i in chunks) <= cap
    assert len(chunks) == 10  # 4 * puts distinct chunks written, the cap keeps exactly ten
    assert store.usage().bytes == sum(i.size for i in chunks)
