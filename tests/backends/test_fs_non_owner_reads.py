"""Maintenance reads by a user who does not own the chunk files (an operator's ``verify``,
``show`` or ``cp`` over an engine's store) are not uses: the kernel refuses such a reader
``O_NOATIME``, so on a mount without ``noatime`` its reads move the files' atime, but the
store takes an access time only as far as its own explicit ``utime`` moved it, which moves
the ctime too (spec/FORMAT.md 6.5). Nothing is written and nothing is warned about."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends import _fsio
from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks

CHUNK, OTHER = sample_chunks(2, seed=67)

pytestmark = pytest.mark.skipif(not _fsio._O_NOATIME, reason="no O_NOATIME on this platform")


def _stat(atime: float, mtime: float, ctime: float) -> os.stat_result:
    """A file's stat with these times (mode, inode, ... as for a 100-byte regular file)."""
    return os.stat_result((0o100644, 7, 1, 1, 0, 0, 100, atime, mtime, ctime))


def test_an_atime_past_the_ctime_is_bounded_by_it() -> None:
    """A plain read moved the atime (the ctime stayed): the use is the last explicit one."""
    assert _fsio._filestat(_stat(atime=5_000.0, mtime=1_000.0, ctime=2_000.0)).atime == 2_000.0
    # the store's own record (utime moves both) and an atime set in the past count as they are
    assert _fsio._filestat(_stat(atime=2_000.0, mtime=1_000.0, ctime=2_000.0)).atime == 2_000.0
    assert _fsio._filestat(_stat(atime=1_500.0, mtime=1_000.0, ctime=9_000.0)).atime == 1_500.0


@pytest.fixture
def as_non_owner(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """From the call on, ``os.open`` answers ``O_NOATIME`` as the kernel answers a reader who
    does not own the file (EPERM): reads fall back to plain opens, which move atimes."""

    def start() -> None:
        real_open = os.open

        def open_as_non_owner(path: Any, flags: int, *args: Any) -> int:
            if flags & _fsio._O_NOATIME:
                raise PermissionError(errno.EPERM, "Operation not permitted", path)
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", open_as_non_owner)

    return start


def _stored(tmp_path: Path) -> tuple[FsStore, list[str]]:
    store = FsStore(str(tmp_path / "s"), create=True)
    store.put_many([(CHUNK.key, CHUNK.data), (OTHER.key, OTHER.data)])
    return store, [store.path_of(CHUNK.key), store.path_of(OTHER.key)]


def _moved_atimes(paths: list[str], before: list[os.stat_result]) -> bool:
    """Whether the reads moved every file's kernel atime past its ctime (False on mounts that
    do not update atimes on reads: noatime)."""
    return all(os.stat(p).st_atime_ns > b.st_ctime_ns for p, b in zip(paths, before))


@pytest.mark.parametrize("command", ["verify", "show", "cp"])
def test_non_owner_maintenance_reads_are_not_uses(
    tmp_path: Path,
    as_non_owner: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    from chunkstore.cli.main import main

    store, paths = _stored(tmp_path)
    before = [os.stat(p) for p in paths]
    time.sleep(0.02)  # (a later kernel clock tick: a read's atime then differs from the ctime)
    as_non_owner()
    root = str(tmp_path / "s")
    argv = {
        "verify": ["verify", root, "--dry-run"],
        "show": ["show", root, CHUNK.key.hex],
        "cp": ["cp", root, str(tmp_path / "copy")],
    }[command]
    with caplog.at_level("WARNING"):
        assert main(argv) == 0
    capsys.readouterr()
    keys = [CHUNK.key] if command == "show" else [CHUNK.key, OTHER.key]
    if not _moved_atimes(paths[: len(keys)], before):
        pytest.skip("this mount does not update atimes on reads")
    after = {i.key: i.atime for i in FsStore(root).list()}
    # the reads moved the kernel's atimes, but no use later than the last explicit time
    # change (the write) is recorded
    assert [after[k] <= b.st_ctime for k, b in zip(keys, before)] == [True] * len(keys)
    assert [r.getMessage() for r in caplog.records] == []
    assert not any(n.endswith(".atime") for _, _, names in os.walk(root) for n in names)


def test_the_engine_s_read_after_a_non_owner_read_is_still_recorded(
    tmp_path: Path, as_non_owner: Callable[[], None]
) -> None:
    """A maintenance read's moved atime must not pass for a recent use that makes the store
    skip recording a real one: the last recorded use (here the write) is older than the
    access resolution, the other user's read is not."""
    resolution = 0.1
    store, paths = _stored(tmp_path)
    before = [os.stat(p) for p in paths]
    time.sleep(2 * resolution)  # the write is now older than the resolution
    with open(paths[0], "rb") as f:  # another user's plain read (no O_NOATIME), just now
        f.read()
    if not _moved_atimes(paths[:1], before[:1]):
        pytest.skip("this mount does not update atimes on reads")
    engine = FsStore(str(tmp_path / "s"), access_resolution=resolution)
    first = {i.key: i.atime for i in engine.list()}
    assert engine.get(CHUNK.key) == CHUNK.data
    recorded = {i.key: i.atime for i in engine.list()}
    assert recorded[CHUNK.key] > first[CHUNK.key]  # the engine's read was recorded
    assert recorded[OTHER.key] == first[OTHER.key]
