"""Symbolic links inside a store: maintenance never reaches through one to files outside the
store (spec/FORMAT.md 6.1: a store is its real directories; a link to elsewhere is foreign)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks

CHUNKS = sample_chunks(2, seed=3)
NS = CHUNKS[0].key.namespace


def _chunk_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.rglob("*.kvc")}


@pytest.fixture
def linked(tmp_path: Path) -> tuple[Path, Path]:
    """A store whose namespace directory is a symlink to another store's (the outside),
    which holds one good and one damaged chunk (``verify`` would act on it)."""
    outside = tmp_path / "outside"
    with FsStore(str(outside), create=True) as other:
        for chunk in CHUNKS:
            other.put(chunk.key, chunk.data)
    damaged = outside / CHUNKS[1].key.path
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    root = tmp_path / "store"
    FsStore(str(root), create=True).close()
    (root / NS).symlink_to(outside / NS, target_is_directory=True)
    return root, outside


@pytest.mark.parametrize(
    "args",
    [
        ("prune", "--namespace", NS),
        ("prune", "--namespace", NS, "--max-bytes", "0"),
        ("verify", "--namespace", NS, "--delete"),
        ("verify", "--namespace", NS),
    ],
    ids=["prune-namespace", "prune-max-bytes", "verify-delete", "verify-quarantine"],
)
def test_maintenance_leaves_a_symlinked_namespace_alone(cli, linked, args) -> None:
    root, outside = linked
    before = _chunk_files(outside)
    result = cli(args[0], root, *args[1:])
    assert result.rc == 0, result.err
    assert _chunk_files(outside) == before
    assert set(before) == {f"{c.key.hex}.kvc" for c in CHUNKS}
    assert not (root / "quarantine").exists()


def test_listing_a_symlinked_namespace_finds_nothing(linked) -> None:
    """By name or not, a namespace that is a link lists alike: empty."""
    root, _ = linked
    with FsStore(str(root)) as store:
        assert list(store.list()) == []
        assert list(store.list(NS)) == []


def test_a_real_namespace_directory_is_still_listed_by_name(tmp_path: Path) -> None:
    """The control: the fix keeps `--namespace` working on ordinary stores."""
    with FsStore(str(tmp_path / "s"), create=True) as store:
        for chunk in CHUNKS:
            store.put(chunk.key, chunk.data)
        assert {i.key for i in store.list(NS)} == {c.key for c in CHUNKS}
    assert os.path.isdir(tmp_path / "s" / NS)
