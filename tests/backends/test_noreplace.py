"""Put-if-absent's publish: a rename that refuses to replace, and the hard link without it."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends import _fsio as fsio
from chunkstore.backends import _noreplace
from chunkstore.backends._fs import FsStore
from chunkstore.backends._fsio import LocalIO
from chunkstore.backends._noreplace import rename_noreplace
from chunkstore.testing.factories import sample_chunks

needs_renameat2 = pytest.mark.skipif(
    _noreplace._renameat2() is None, reason="this system's C library has no renameat2"
)


def _file(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@needs_renameat2
def test_it_renames_onto_a_free_name(tmp_path: Path) -> None:
    src = _file(tmp_path / "tmp", b"new")
    assert rename_noreplace(src, str(tmp_path / "final")) is True
    assert not os.path.exists(src)
    assert (tmp_path / "final").read_bytes() == b"new"


@needs_renameat2
def test_it_leaves_both_files_when_the_name_is_taken(tmp_path: Path) -> None:
    src = _file(tmp_path / "tmp", b"new")
    dst = _file(tmp_path / "final", b"old")
    assert rename_noreplace(src, dst) is False
    assert (tmp_path / "tmp").read_bytes() == b"new"
    assert (tmp_path / "final").read_bytes() == b"old"


@needs_renameat2
def test_a_missing_source_raises_as_a_rename_would(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        rename_noreplace(str(tmp_path / "gone"), str(tmp_path / "final"))
    assert caught.value.filename == str(tmp_path / "gone")


def _refusing(code: int) -> Any:
    """A renameat2 stand-in that fails with ``code``, as a kernel or filesystem without the
    flag does (EINVAL) or one without the call (ENOSYS)."""
    calls: list[bytes] = []

    def call(_at: int, src: bytes, _at2: int, _dst: bytes, _flags: int) -> int:
        calls.append(src)
        ctypes.set_errno(code)
        return -1

    call.calls = calls  # type: ignore[attr-defined]
    return call


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_system_without_it_answers_none_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    monkeypatch.setattr(_noreplace, "_call", _refusing(code))
    monkeypatch.setattr(_noreplace, "_loaded", True)
    src = _file(tmp_path / "tmp", b"new")
    assert rename_noreplace(src, str(tmp_path / "final")) is None
    assert os.listdir(tmp_path) == ["tmp"]


def test_without_it_the_store_links_and_stops_asking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that refuses the flag is asked once; every later publish links, with
    the same outcome: one winner, the temp name gone."""
    refusing = _refusing(errno.EINVAL)
    monkeypatch.setattr(_noreplace, "_call", refusing)
    monkeypatch.setattr(_noreplace, "_loaded", True)
    links: list[str] = []
    real_link = os.link

    def counting_link(src: str, dst: str) -> None:
        links.append(dst)
        real_link(src, dst)

    monkeypatch.setattr(fsio.os, "link", counting_link)
    io = LocalIO()
    finals = [str(tmp_path / f"f{i}") for i in range(3)]
    for i, final in enumerate(finals):
        assert io.link_if_absent(_file(tmp_path / f"t{i}", b"a"), final, False) is True
    assert io.link_if_absent(_file(tmp_path / "t9", b"b"), finals[0], False) is False
    assert len(refusing.calls) == 1
    assert links == [*finals, finals[0]]
    assert sorted(os.listdir(tmp_path)) == ["f0", "f1", "f2"]
    assert (tmp_path / "f0").read_bytes() == b"a"


@needs_renameat2
def test_with_it_the_store_publishes_by_rename_not_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_link(src: str, dst: str) -> None:
        raise AssertionError("put_if_absent linked where it could rename")

    monkeypatch.setattr(fsio.os, "link", no_link)
    store = FsStore(str(tmp_path / "cache"), create=True)
    chunk = sample_chunks(1, seed=3)[0]
    assert store.put_if_absent(chunk.key, chunk.data) is True
    assert store.put_if_absent(chunk.key, b"other bytes") is False
    assert bytes(store.get(chunk.key) or b"") == chunk.data
    assert store.orphans() == []
    store.close()


@pytest.mark.parametrize("path", ["rename", "link"])
def test_racing_writers_of_one_key_have_one_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    if path == "link":
        monkeypatch.setattr(_noreplace, "_call", None)
        monkeypatch.setattr(_noreplace, "_loaded", True)
    elif _noreplace._renameat2() is None:
        pytest.skip("this system's C library has no renameat2")
    stores = [FsStore(str(tmp_path / "cache"), create=True) for _ in range(4)]
    chunks = sample_chunks(16, seed=8)
    wins: list[list[bool]] = [[] for _ in stores]
    barrier = threading.Barrier(len(stores))

    def race(side: int) -> None:
        barrier.wait(timeout=30)
        wins[side] = [stores[side].put_if_absent(c.key, c.data) for c in chunks]

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert [sum(column) for column in zip(*wins, strict=True)] == [1] * len(chunks)
        assert [bytes(stores[0].get(c.key) or b"") for c in chunks] == [c.data for c in chunks]
        assert stores[0].orphans() == []
    finally:
        for store in stores:
            store.close()
