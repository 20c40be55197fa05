"""A store takes a file's atime only up to its ctime (spec/FORMAT.md 6.5). Some mounts keep
no ctime of their own: sshfs reports the mtime as the ctime, so a time the store sets never
shows. There the store notices its first set time missing and records uses in access
records instead, and least recently used stays least recently used."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends import _fsio
from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks

OLD, NEW = sample_chunks(2, seed=73)


class _CtimeIsMtime:
    """A stat as sshfs answers it: the ctime is the mtime."""

    def __init__(self, st: os.stat_result) -> None:
        self._st = st

    def __getattr__(self, name: str) -> Any:
        if name in ("st_ctime", "st_ctime_ns"):
            return getattr(self._st, name.replace("ctime", "mtime"))
        return getattr(self._st, name)


@pytest.fixture
def sshfs_like(monkeypatch: pytest.MonkeyPatch) -> None:
    real = _fsio._filestat
    monkeypatch.setattr(
        _fsio, "_filestat", lambda st, regular=True: real(_CtimeIsMtime(st), regular)
    )


def _written_a_while_ago(tmp_path: Path) -> FsStore:
    """A store holding OLD (written two minutes ago) and NEW (one minute ago)."""
    store = FsStore(str(tmp_path / "s"), create=True, access_resolution=0)
    store.put_many([(OLD.key, OLD.data), (NEW.key, NEW.data)])
    now = time.time()
    os.utime(store.path_of(OLD.key), (now - 120, now - 120))
    os.utime(store.path_of(NEW.key), (now - 60, now - 60))
    return store


def _records(root: Path) -> list[str]:
    return [n for _, _, names in os.walk(root) for n in names if n.endswith(".atime")]


def test_a_use_counts_where_the_ctime_is_the_mtime(tmp_path: Path, sshfs_like: None) -> None:
    store = _written_a_while_ago(tmp_path)
    for _ in range(2):  # (the second read goes to the record straight away)
        assert store.get(OLD.key) == OLD.data
    used = {i.key: i.atime for i in FsStore(store.root).list()}
    assert used[OLD.key] > used[NEW.key]  # OLD was just read: no longer least recently used
    assert _records(tmp_path) == [f"{OLD.key.hex}.kvc.atime"]


def test_a_mount_that_keeps_ctimes_needs_no_records(tmp_path: Path) -> None:
    store = _written_a_while_ago(tmp_path)
    assert store.get(OLD.key) == OLD.data
    used = {i.key: i.atime for i in FsStore(store.root).list()}
    assert used[OLD.key] > used[NEW.key]
    assert _records(tmp_path) == []
