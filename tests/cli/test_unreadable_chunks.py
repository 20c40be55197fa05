"""A chunk the store cannot read (EIO, ESTALE, EACCES) is reported as unreadable, not as
vanished, and ``verify``/``cp`` exit with FAILURE; nothing is quarantined or copied for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import FAILURE
from chunkstore.testing.factories import sample_chunks
from tests.cli.faults import EIO, fail_on_path

CHUNKS = sample_chunks(4, seed=3)
BAD = CHUNKS[1].key


def stocked(root: Path) -> str:
    """Write the 4 good chunks at ``root``; the path of the one that will fail to read."""
    with FsStore(str(root), create=True) as store:
        for c in CHUNKS:
            store.put(c.key, c.data)
        return store.path_of(BAD)


@pytest.fixture
def src(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A store of 4 good chunks whose second one reads with EIO (a failing sector)."""
    root = tmp_path / "src"
    fail_on_path(monkeypatch, "read", stocked(root), EIO)
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
    fail_on_path(monkeypatch, "read_ranges", stocked(root), EIO)
    result = cli("inspect", root, "--json")
    assert result.rc == FAILURE
    doc = result.json()
    assert doc["unreadable"] == [{"key": BAD.hex, "namespace": BAD.namespace}]
    assert doc["corrupt"] == []
    text = cli("inspect", root)
    assert text.rc == FAILURE and "unreadable:        1" in text.out
