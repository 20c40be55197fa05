"""The capacity ledger stays true when stores without a cap (the CLI) write and delete in a
capped store's root, and an admit recounts when its eviction candidates turn out to be gone."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.cli.main import main
from chunkstore.errors import StoreError
from chunkstore.hashing import ChunkKey
from chunkstore.testing.factories import sample_chunks
from tests.cli.faults import EACCES, fail_on_path

CHUNKS = sample_chunks(16, seed=7)
SIZE = len(CHUNKS[0].data)
NS_OLD, NS_NEW = "00000000000000aa", "00000000000000bb"


def key(i: int, ns: str) -> ChunkKey:
    return ChunkKey(CHUNKS[i].key.digest, ns)


def count(root: Path, ns: str | None = None) -> int:
    return sum(1 for _ in FsStore(str(root)).list(ns))


def ledger(root: Path) -> dict[str, int]:
    doc: dict[str, int] = json.loads((root / ".chunkstore" / "usage.json").read_text())
    return doc


def fill(writer: FsStore, entries: list[tuple[int, str]]) -> None:
    """Put ``entries`` in order, each one second newer than the one before."""
    now = time.time()
    for n, (i, ns) in enumerate(entries):
        writer.put(key(i, ns), CHUNKS[i].data)
        os.utime(writer.path_of(key(i, ns)), (now - 1000 + n, now - 1000 + n))


def test_cli_prune_updates_the_ledger_and_the_writer_evicts_nothing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    writer = FsStore(str(root), create=True, max_bytes=8 * SIZE, access_resolution=0)
    fill(writer, [(i, NS_OLD) for i in range(4)] + [(i, NS_NEW) for i in range(4, 9)])
    assert writer.capacity is not None and writer.capacity.evicted == 1
    assert main(["prune", str(root), "--namespace", NS_NEW, "-q"]) == 0
    assert ledger(root)["chunks"] == count(root) == 3
    assert ledger(root)["max_bytes"] == 8 * SIZE  # the uncapped CLI kept the recorded cap
    for i in range(9, 12):
        writer.put(key(i, NS_NEW), CHUNKS[i].data)
    assert count(root, NS_OLD) == 3  # 6 of 8: nothing had to go
    assert writer.capacity.evicted == 1


def test_cli_cp_into_a_capped_store_counts_its_chunks(tmp_path: Path) -> None:
    root = tmp_path / "s"
    writer = FsStore(str(root), create=True, max_bytes=6 * SIZE, access_resolution=0)
    fill(writer, [(n, NS_OLD) for n in range(7)])
    src = tmp_path / "src"
    with FsStore(str(src), create=True) as s:
        for i in range(4):
            s.put(CHUNKS[i].key, CHUNKS[i].data)
    assert main(["cp", str(src), str(root), "-q"]) == 0
    assert ledger(root)["chunks"] == count(root) == 10  # cp does not evict, but is counted
    for i in range(7, 11):
        writer.put(key(i, NS_OLD), CHUNKS[i].data)
    assert count(root) == 6


def test_uncapped_store_without_a_ledger_makes_no_state_files(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path / "s"), create=True)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    store.delete_many([CHUNKS[0].key])
    assert not (tmp_path / "s" / ".chunkstore").exists()


def test_admit_recounts_when_candidates_vanished(tmp_path: Path) -> None:
    root = tmp_path / "s"
    writer = FsStore(str(root), create=True, max_bytes=8 * SIZE, access_resolution=0)
    fill(writer, [(i, NS_OLD) for i in range(9)])  # the 9th put scans and evicts chunk 0
    assert writer.capacity is not None and writer.capacity.evicted == 1
    for i in range(1, 6):  # removed by hand: the ledger still says 8
        os.unlink(writer.path_of(key(i, NS_OLD)))
    for i in range(9, 12):  # 3 + 3 = 6 of 8: nothing needs to go
        writer.put(key(i, NS_OLD), CHUNKS[i].data)
    assert count(root) == 6
    assert writer.capacity.evicted == 1
    assert ledger(root)["chunks"] == 6


def test_delete_that_may_not_unlink_raises_store_error_and_keeps_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    store = FsStore(str(root), create=True, max_bytes=8 * SIZE)
    keys = [key(i, NS_OLD) for i in range(4)]
    for i, k in enumerate(keys):
        store.put(k, CHUNKS[i].data)
    locked = store.path_of(keys[2])
    fail_on_path(monkeypatch, "remove", locked, EACCES)
    with pytest.raises(StoreError, match="cannot delete .*Permission denied; 3 other"):
        store.delete_many(keys)
    assert count(root) == 1 and ledger(root)["chunks"] == 1  # the others went, and counted


def test_a_killed_writers_ledger_temp_does_not_block_writes(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, max_bytes="1M")
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    state = tmp_path / "s" / ".chunkstore"
    # the temp name the ledger write used to pick, left by a writer killed before its rename
    (state / f".usage.json.{os.getpid()}.{threading.get_ident()}.tmp").write_bytes(b"{")
    assert store.put(CHUNKS[1].key, CHUNKS[1].data)
    assert ledger(tmp_path / "s")["chunks"] == 2
