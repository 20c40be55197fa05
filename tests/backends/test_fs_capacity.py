"""FsStore ``max_bytes``: hand-traced LRU eviction by store-kept access time, and the ledger."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.errors import ConfigError
from chunkstore.testing.factories import sample_chunks
from chunkstore.units import parse_size

CHUNKS = sample_chunks(8, seed=31)
SIZE = len(CHUNKS[0].data)


def capped(tmp_path: Path, chunks: int) -> FsStore:
    return FsStore(str(tmp_path), create=True, max_bytes=chunks * SIZE, access_resolution=0)


def age(store: FsStore, index: int, seconds_ago: float) -> None:
    """Pretend chunk ``index`` was written and last read ``seconds_ago``."""
    stamp = time.time() - seconds_ago
    os.utime(store.path_of(CHUNKS[index].key), (stamp, stamp))


def present(store: FsStore) -> list[int]:
    keys = {info.key for info in store.list()}
    return [i for i, c in enumerate(CHUNKS) if c.key in keys]


def test_evicts_least_recently_used(tmp_path: Path) -> None:
    store = capped(tmp_path, 3)
    for i in range(3):
        store.put(CHUNKS[i].key, CHUNKS[i].data)
        age(store, i, 100 - i)  # 0 oldest, 2 newest
    assert store.get(CHUNKS[0].key) is not None  # 0 becomes most recently used
    store.put(CHUNKS[3].key, CHUNKS[3].data)  # evicts 1, the least recently read
    assert present(store) == [0, 2, 3]
    age(store, 3, 50)
    store.put(CHUNKS[4].key, CHUNKS[4].data)  # evicts 2 (read 98 s ago, before 3 at 50 s)
    assert present(store) == [0, 3, 4]
    assert store.usage().bytes == 3 * SIZE and store.usage().chunks == 3
    assert store.capacity is not None and store.capacity.evicted == 2


def test_overwrite_and_put_if_absent_do_not_evict(tmp_path: Path) -> None:
    store = capped(tmp_path, 2)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    store.put(CHUNKS[1].key, CHUNKS[1].data)
    assert store.put(CHUNKS[1].key, CHUNKS[1].data) is True
    assert store.put_if_absent(CHUNKS[0].key, CHUNKS[0].data) is False
    assert present(store) == [0, 1]
    assert store.usage().bytes == 2 * SIZE


def test_chunk_larger_than_cap_is_not_stored(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True, max_bytes=SIZE - 1)
    assert store.put(CHUNKS[0].key, CHUNKS[0].data) is False
    assert present(store) == []
    assert os.listdir(os.path.dirname(store.path_of(CHUNKS[0].key))) == []  # no temp left


def test_fresh_process_uses_the_ledger_and_recounts_drift(tmp_path: Path) -> None:
    first = capped(tmp_path, 3)
    for i in range(3):
        first.put(CHUNKS[i].key, CHUNKS[i].data)
    ledger = tmp_path / ".chunkstore" / "usage.json"
    assert json.loads(ledger.read_text())["bytes"] == 3 * SIZE
    os.unlink(first.path_of(CHUNKS[0].key))  # removed behind the store's back
    second = capped(tmp_path, 3)
    second.put(CHUNKS[3].key, CHUNKS[3].data)  # ledger says full: the eviction scan recounts
    assert len(present(second)) == 3
    assert json.loads(ledger.read_text())["bytes"] == 3 * SIZE
    ledger.write_text("{torn")
    assert second.usage().bytes == 3 * SIZE  # unreadable ledger: recounted


def test_delete_and_quarantine_update_the_ledger(tmp_path: Path) -> None:
    store = capped(tmp_path, 4)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    store.put(CHUNKS[1].key, CHUNKS[1].data[:-1])
    assert store.delete(CHUNKS[0].key)
    assert store.get(CHUNKS[1].key) is None  # corrupt: quarantined
    assert store.usage().bytes == 0 and store.usage().chunks == 0


def test_parse_size() -> None:
    assert parse_size("500G") == 500 << 30
    assert parse_size("1.5KiB") == 1536
    assert parse_size("64mib") == 64 << 20
    assert parse_size("64mb") == 64_000_000
    assert parse_size(10) == 10
    for bad in ("-1", "ten", True, -5):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_refused_writes_leave_no_temp_files(tmp_path: Path) -> None:
    store = capped(tmp_path, 1)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    assert store.put_if_absent(CHUNKS[0].key, CHUNKS[0].data) is False
    small = FsStore(str(tmp_path), max_bytes=SIZE - 1)
    assert small.put_if_absent(CHUNKS[1].key, CHUNKS[1].data) is False
    assert small.put(CHUNKS[1].key, CHUNKS[1].data) is False
    assert store.orphans() == []


def test_cap_through_fsspec_warns_that_it_holds_per_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Review #13: fsspec has no cross-process lock, so the cap is per writer process there;
    the store says so at open. Local paths (flock) hold it across processes: no warning."""
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/cap-{tmp_path.name}"
    try:
        FsStore(root, fs=fs, create=True, max_bytes=SIZE)
        assert "holds per writer process" in caplog.text
        caplog.clear()
        FsStore(root, fs=fs)  # no cap: nothing to say
        capped(tmp_path, 2)
        assert "per writer process" not in caplog.text
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "7",
        '"bytes"',
        '{"bytes": 1e999, "chunks": 2}',
        '{"bytes": -1000000, "chunks": 2}',
        '{"bytes": 1.5, "chunks": 2}',
        '{"bytes": true, "chunks": 2}',
        '{"bytes": 16384, "chunks": -3}',
    ],
    ids=["list", "number", "string", "infinite", "negative", "fraction", "boolean", "neg-count"],
)
def test_damaged_ledger_is_recounted_not_raised_or_believed(tmp_path: Path, text: str) -> None:
    """Spec 6.6: a ledger a writer cannot read is recounted under the lock; one that is not
    an object of two non-negative integers cannot be read (it is no ledger this code wrote)."""
    store = capped(tmp_path, 3)
    for i in range(2):
        store.put(CHUNKS[i].key, CHUNKS[i].data)
    ledger = tmp_path / ".chunkstore" / "usage.json"
    ledger.write_text(text)
    assert (store.usage().bytes, store.usage().chunks) == (2 * SIZE, 2)
    ledger.write_text(text)
    assert store.put(CHUNKS[2].key, CHUNKS[2].data) is True
    assert json.loads(ledger.read_text())["bytes"] == 3 * SIZE


def test_ledger_that_cannot_be_opened_is_recounted_and_replaced(tmp_path: Path) -> None:
    """A FIFO at the ledger's name (or one the writer may not read): recounted under the
    lock like a torn ledger, and the next save puts a real ledger in its place."""
    store = capped(tmp_path, 3)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    ledger = tmp_path / ".chunkstore" / "usage.json"
    ledger.unlink()
    os.mkfifo(ledger)
    assert store.put(CHUNKS[1].key, CHUNKS[1].data) is True
    assert ledger.is_file() and json.loads(ledger.read_text())["bytes"] == 2 * SIZE
