"""Symbolic links inside a store: maintenance never reaches through one to files outside the
store, and the store never writes its own files (quarantine, ledger, model records) through
one (spec/FORMAT.md 6.1: a store is its real directories; a link to elsewhere is foreign)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.errors import StoreError
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


@pytest.fixture
def with_outside(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A store holding one damaged chunk, and an outside directory holding files named as
    the store would name its quarantined chunk and its ledger."""
    root = tmp_path / "store"
    with FsStore(str(root), create=True) as store:
        store.put(CHUNKS[0].key, CHUNKS[0].data)
        path = Path(store.path_of(CHUNKS[0].key))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    outside = tmp_path / "outside"
    victim = outside / NS / f"{CHUNKS[0].key.hex}.kvc"
    victim.parent.mkdir(parents=True)
    victim.write_text("someone's file")
    (outside / "usage.json").write_text("someone's usage.json")
    return root, outside, victim


@pytest.mark.parametrize("own", ["quarantine", ".chunkstore"])
def test_a_store_whose_own_directory_is_a_symlink_is_refused(cli, with_outside, own) -> None:
    """verify moved the damaged chunk out of the store through a symlinked quarantine,
    replacing the outside file of its name; a capped writer replaced <outside>/usage.json."""
    root, outside, victim = with_outside
    (root / own).symlink_to(outside, target_is_directory=True)
    result = cli("verify", root)
    assert result.rc == 4
    assert result.err.count("\n") == 1 and f"{own} is a symbolic link" in result.err
    assert victim.read_text() == "someone's file"
    assert (outside / "usage.json").read_text() == "someone's usage.json"
    assert sorted(p.name for p in outside.rglob("*")) == sorted([NS, victim.name, "usage.json"])


def test_quarantine_never_moves_a_chunk_through_a_symlinked_namespace_directory(
    with_outside,
) -> None:
    """A link made after the store was opened, one level down: the corrupt read is a miss,
    the chunk stays where it is, nothing outside changes."""
    root, outside, victim = with_outside
    with FsStore(str(root)) as store:
        (root / "quarantine").mkdir()
        (root / "quarantine" / NS).symlink_to(outside / NS, target_is_directory=True)
        assert store.get(CHUNKS[0].key) is None
        assert os.path.exists(store.path_of(CHUNKS[0].key))
    assert victim.read_text() == "someone's file"
    assert sorted(p.name for p in (outside / NS).iterdir()) == [victim.name]


def test_model_records_are_not_written_through_a_symlinked_directory(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    with FsStore(str(tmp_path / "store"), create=True) as store:
        (tmp_path / "store" / ".chunkstore").mkdir()
        (tmp_path / "store" / ".chunkstore" / "models").symlink_to(outside)
        with pytest.raises(StoreError, match="models is a symbolic link"):
            store.write_model_record(bytes(32), b"{}")
    assert list(outside.iterdir()) == []


def test_entries_that_are_not_regular_files_are_foreign(tmp_path: Path) -> None:
    """Spec 6.1: anything in a fan-out directory that is not a chunk, an access record or a
    temp file is foreign, reported and never served, listed as a chunk or removed: a
    symlink named like a chunk (to a chunk outside the store), a FIFO, a directory."""
    outside = FsStore(str(tmp_path / "outside"), create=True)
    outside.put(CHUNKS[1].key, CHUNKS[1].data)
    store = FsStore(str(tmp_path / "store"), create=True)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    leaf = Path(store.path_of(CHUNKS[0].key)).parent
    linked = Path(store.path_of(CHUNKS[1].key))
    linked.parent.mkdir(parents=True, exist_ok=True)
    linked.symlink_to(outside.path_of(CHUNKS[1].key))
    os.mkfifo(leaf / "pipe")
    (leaf / ("0" * 64 + ".kvc.atime")).mkdir()
    assert [info.key for info in store.list()] == [CHUNKS[0].key]
    foreign = sorted(Path(f.path).name for f in store.foreign_files())
    assert foreign == sorted([linked.name, "pipe", "0" * 64 + ".kvc.atime"])
    assert store.orphans() == [] and store.remove_orphans(grace=0) == 0
    assert linked.is_symlink() and Path(outside.path_of(CHUNKS[1].key)).exists()
