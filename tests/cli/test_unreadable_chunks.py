"""A chunk the store cannot read (EIO, ESTALE, EACCES) is reported as unreadable, not as
vanished, and ``verify``/``cp`` exit with FAILURE; nothing is quarantined or copied for it."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from chunkstore.backends import _fsio
from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import FAILURE
from chunkstore.testing.factories import sample_chunks

CHUNKS = sample_chunks(4, seed=3)
BAD = CHUNKS[1].key


@pytest.fixture
def src(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A store of 4 good chunks whose second one reads with EIO (a failing sector)."""
    root = tmp_path / "src"
    with FsStore(str(root), create=True) as store:
        for c in CHUNKS:
            store.put(c.key, c.data)
        bad = store.path_of(BAD)
    real = _fsio.LocalIO.read

    def read(self: _fsio.LocalIO, path: str) -> object:
        if path == bad:
            raise OSError(errno.EIO, "Input/output error", path)
        return real(self, path)

    monkeypatch.setattr(_fsio.LocalIO, "read", read)
    return root


def test_verify_reports_unreadable_and_fails(cli, src: Path) -> None:
    result = cli("verify", src, "--json")
    assert result.rc == FAILURE
    doc = result.json()
    assert doc["checked"] == 3 and doc["ok"] == 3 and doc["vanished"] == 0
    assert doc["unreadable"] == [{"key": BAD.hex, "namespace": BAD.namespace}]
    assert doc["corrupt"] == []
    assert FsStore(str(src)).exists(BAD)  # not quarantined: it was never judged
    text = cli("verify", src)
    assert text.rc == FAILURE and "1 unreadable" in text.out and BAD.hex in text.out


def test_cp_reports_unreadable_and_fails(cli, src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    result = cli("cp", src, dst, "--json")
    assert result.rc == FAILURE
    doc = result.json()
    assert doc["copied"] == 3 and doc["vanished"] == 0
    assert doc["unreadable"] == [{"key": BAD.hex, "namespace": BAD.namespace}]
    assert not FsStore(str(dst)).exists(BAD)


def test_inspect_reports_unreadable_and_fails(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    with FsStore(str(root), create=True) as store:
        for c in CHUNKS:
            store.put(c.key, c.data)
        bad = store.path_of(BAD)
    real = _fsio.LocalIO.read_ranges

    def read_ranges(self: _fsio.LocalIO, path: str, ranges: object) -> object:
        if path == bad:
            raise OSError(errno.EIO, "Input/output error", path)
        return real(self, path, ranges)  # type: ignore[arg-type]

    monkeypatch.setattr(_fsio.LocalIO, "read_ranges", read_ranges)
    result = cli("inspect", root, "--json")
    assert result.rc == FAILURE
    doc = result.json()
    assert doc["unreadable"] == [{"key": BAD.hex, "namespace": BAD.namespace}]
    assert doc["corrupt"] == []
    text = cli("inspect", root)
    assert text.rc == FAILURE and "unreadable:        1" in text.out
