"""FsStore reads that fail with an OS error (EIO, EACCES, ESTALE, a directory at a chunk's
path) are logged, counted misses: nothing but a miss reaches the serving path."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest

from chunkstore.backends import _fsio
from chunkstore.backends._fs import FsStore
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import MadeChunk, sample_chunks, small_spec

CHUNK, OTHER = sample_chunks(2, seed=41)
RANGES = ChunkLayout(small_spec()).rank_ranges(0, 2)


def _every_read(store: FsStore, chunk: MadeChunk) -> dict[str, Any]:
    """What each read entry point returns for ``chunk`` (any exception fails the test)."""
    return {
        "get": store.get(chunk.key),
        "get_many": store.get_many([chunk.key])[0],
        "get_into": store.get_into(chunk.key, bytearray(len(chunk.data) + 4096)),
        "read_ranges": store.read_ranges(chunk.key, RANGES),
        "read_unchecked_many": store.read_unchecked_many([chunk.key])[0],
    }


@pytest.mark.parametrize("verify", [True, False])
def test_directory_at_a_chunk_path_is_a_miss(tmp_path: Path, verify: bool) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, verify=verify)
    store.put(OTHER.key, OTHER.data)
    os.makedirs(store.path_of(CHUNK.key))
    assert set(_every_read(store, CHUNK).values()) == {None}
    assert store.exists(CHUNK.key) is False
    assert store.exists_many([OTHER.key, CHUNK.key]) == [True, False]
    assert store.lookup_prefix([OTHER.key, CHUNK.key]) == 1
    assert store.read_errors > 0 and store.corrupt_detected == 0
    assert os.path.isdir(store.path_of(CHUNK.key))  # not ours to remove


def test_fifo_at_a_chunk_path_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path / "s"), create=True)
    path = store.path_of(CHUNK.key)
    os.makedirs(os.path.dirname(path))
    os.mkfifo(path)  # opening a FIFO for reading blocks until a writer comes: never here
    assert set(_every_read(store, CHUNK).values()) == {None}
    assert store.exists(CHUNK.key) is False


class FaultyFile:
    """Makes the OS fail reads of one file with ``err``: at open for EACCES/ESTALE, on the
    data (after a successful open) for EIO."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: str, err: int) -> None:
        self.path, self.err = path, err
        self.fds: set[int] = set()
        self._open, self._close = os.open, os.close
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "close", self.close)
        for name in ("read", "pread", "preadv"):
            monkeypatch.setattr(os, name, self._on_fd(getattr(os, name)))

    def _fail(self) -> OSError:
        cls = PermissionError if self.err == errno.EACCES else OSError
        return cls(self.err, os.strerror(self.err), self.path)

    def open(self, path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path) != self.path:
            return self._open(path, *args, **kwargs)
        if self.err != errno.EIO:
            raise self._fail()
        fd = self._open(path, *args, **kwargs)
        self.fds.add(fd)
        return fd

    def close(self, fd: int) -> None:
        self.fds.discard(fd)  # the number may be reused for another file
        self._close(fd)

    def _on_fd(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, *args: Any) -> Any:
            if fd in self.fds:
                raise self._fail()
            return real(fd, *args)

        return call


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES, errno.ESTALE])
def test_os_errors_are_counted_misses(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    verify: bool,
    err: int,
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, verify=verify)
    store.put_many([(CHUNK.key, CHUNK.data), (OTHER.key, OTHER.data)])
    target = store.path_of(CHUNK.key)
    FaultyFile(monkeypatch, target, err)
    assert set(_every_read(store, CHUNK).values()) == {None}
    assert store.read_errors == 5 and store.corrupt_detected == 0
    assert "treated as a miss" in caplog.text and os.strerror(err) in caplog.text
    assert bytes(store.get(OTHER.key) or b"") == OTHER.data  # other chunks unaffected
    monkeypatch.undo()
    assert os.path.exists(target)  # unreadable is not damage: never quarantined


def test_fsspec_read_errors_are_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    fs = fsspec.filesystem("memory")
    store = FsStore("/read-errors", fs=fs, create=True)
    try:
        store.put(CHUNK.key, CHUNK.data)
        target = store.path_of(CHUNK.key)
        real = fs.cat_file

        def cat_file(path: str, *args: Any, **kwargs: Any) -> Any:
            if path.lstrip("/") == target.lstrip("/"):
                raise OSError(errno.EIO, "I/O error")
            return real(path, *args, **kwargs)

        monkeypatch.setattr(fs, "cat_file", cat_file)
        assert set(_every_read(store, CHUNK).values()) == {None}
        assert store.read_errors == 5 and store.corrupt_detected == 0
    finally:
        fs.rm("/read-errors", recursive=True)


@pytest.mark.skipif(not _fsio._O_NOATIME, reason="no O_NOATIME on this platform")
def test_noatime_refused_falls_back_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = FsStore(str(tmp_path / "s"), create=True)
    store.put(CHUNK.key, CHUNK.data)
    store.put(OTHER.key, OTHER.data)
    real_open = os.open

    def open_as_non_owner(path: Any, flags: int, *args: Any) -> int:
        if flags & _fsio._O_NOATIME:  # what the kernel answers a reader who is not the owner
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_as_non_owner)
    with caplog.at_level("WARNING", logger="chunkstore.backends._fsio"):
        assert store.read_unchecked_many([CHUNK.key, OTHER.key]) == [CHUNK.data, OTHER.data]
    # nothing to warn about: what such reads do to atimes is not taken for a use
    # (test_fs_non_owner_reads.py)
    assert caplog.records == []
    assert store.read_errors == 0
