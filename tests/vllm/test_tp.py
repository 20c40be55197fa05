"""TP > 1: every rank writes its heads into the same shared host slot; chunks are TP-independent.

The scheduler's store owns a shared host pool; simulated ranks are separate
processes running the connector's worker code (``ChunkStoreWorker`` over a
``RankCache``) on CPU KV caches that hold only their heads. The same
conversation saved at TP=1 (in-process path), 2 and 4 gives byte-identical
chunk files, each published once; ranks then load back exactly their heads.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")  # the ranks run worker code only: no vLLM needed

from chunkstore.cache._pool import SHM_DIR  # noqa: E402
from chunkstore.tiering import ProcessCache  # noqa: E402
from chunkstore.vllm.shared import acquire_shared, release_shared, shared_names

from .tp_rank import TOKENS, engine_for, save_in_process, serve  # noqa: E402

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")


class Ranks:
    """Four long-lived rank processes (spawned once: importing vLLM costs more than the work)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.replies: Any = context.Queue()
        self.commands = [context.Queue() for _ in range(4)]
        self.processes = [
            context.Process(target=serve, args=(q, self.replies), daemon=True)
            for q in self.commands
        ]
        for process in self.processes:
            process.start()

    def run(self, op: str, pool: str, tp: int) -> list[Any]:
        for rank in range(tp):
            self.commands[rank].put((op, pool, rank, tp))
        replies = sorted((self.replies.get(timeout=120) for _ in range(tp)), key=lambda r: r[1])
        errors = [r[2] for r in replies if r[0] == "error"]
        assert not errors, errors[0]
        return [r[2] for r in replies]

    def close(self) -> None:
        for q in self.commands:
            q.put(("exit",))
        for process in self.processes:
            process.join(timeout=30)


@pytest.fixture(scope="module")
def ranks():
    r = Ranks()
    yield r
    r.close()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.kvc"))}


def _owner(tmp_path: Path, name: str, shm: str | None) -> ProcessCache:
    layout = engine_for(0, 1).layout
    store_dir = tmp_path / name
    return ProcessCache(
        host_bytes=16 * layout.total_size,
        tiers=[f"file://{store_dir}"],
        layout=layout,
        shm_name=shm,
    )


def test_tp_1_2_4_write_byte_identical_chunks_once_and_ranks_load_their_heads(ranks, tmp_path):
    reference = _owner(tmp_path, "tp1", None)
    try:
        save_in_process(reference)
        reference.flush(timeout=30)
    finally:
        reference.close()
    expected = _files(tmp_path / "tp1")
    assert len(expected) == 3

    for tp in (2, 4):
        shm = f"chunkstore-vllm-tp{tp}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        owner = _owner(tmp_path, f"tp{tp}", shm)
        try:
            sealed = ranks.run("save", shm, tp)
            owner.flush(timeout=30)
            # Every chunk was sealed by exactly one rank and published exactly once.
            assert sum(sealed) == 3
            assert owner.owner.stats().published == 3
            assert _files(tmp_path / f"tp{tp}") == expected
            engine = engine_for(0, 1)
            assert all(owner.host.contains(k) for k in engine.keys(TOKENS, engine.root()))

            # A second save of the same conversation finds the chunks and writes nothing.
            assert ranks.run("save", shm, tp) == [0] * tp
            assert ranks.run("load", shm, tp) == [True] * tp
        finally:
            owner.close()
            Path(SHM_DIR, shm).unlink(missing_ok=True)


def test_engine_shutdown_leaves_nothing_in_dev_shm(ranks, tmp_path):
    """TP = 2 as an engine runs it: the scheduler's connector acquires the store that owns the
    pool, rank processes attach, save and detach; its shutdown (the last release) removes the
    pool's name."""
    shm = f"chunkstore-vllm-life-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    owner = acquire_shared(shm, lambda: _owner(tmp_path, "life", shm))
    try:
        assert (SHM_DIR / shm).exists()
        assert sum(ranks.run("save", shm, 2)) == 3
        owner.flush(timeout=30)
    finally:
        release_shared(shm)
    assert owner.closed
    assert shm not in shared_names()
    assert not (SHM_DIR / shm).exists()
