"""A set-aside killed between its two renames leaves its staged file in ``quarantine/<ns>/``
(a corrupt chunk on its way to its quarantine name) or in ``.chunkstore/`` (a chunk being
deleted). The sweep judges their age by the ctime (the rename that staged them), finishes
the move to quarantine or the delete once past the grace period, and touches nothing else
in those directories.

Times: os.utime cannot set a ctime, so "old" is a grace of 0 seconds or a clock moved on.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from chunkstore.backends import _layout as L
from chunkstore.backends._fs import FsStore
from chunkstore.backends.maintenance import STRANDED_NOTE, SupportsStagingSweep
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

CHUNKS = sample_chunks(2, seed=71)
CHUNK = CHUNKS[0]
BAD = corrupt_copies(CHUNK)["bitflip"]
EARLIER_BAD = corrupt_copies(CHUNK)["truncated"]


def _store(tmp_path: Path, quarantine: str = "move") -> FsStore:
    return FsStore(str(tmp_path / "s"), create=True, quarantine=quarantine)


def _killed_after_staging(store: FsStore, data: bytes, *, delete: bool) -> Path:
    """Put ``data`` as CHUNK, then do a set-aside's first rename only (killed after it)."""
    store.put(CHUNK.key, data)
    root = Path(store.root)
    staging = root / L.STATE_DIR if delete else root / L.QUARANTINE_DIR / CHUNK.key.namespace
    staging.mkdir(parents=True, exist_ok=True)
    staged = staging / L.temp_name(CHUNK.key.hex)
    os.rename(store.path_of(CHUNK.key), staged)
    return staged


def _quarantine_dir(store: FsStore) -> Path:
    return Path(store.root) / L.QUARANTINE_DIR / CHUNK.key.namespace


def test_a_stranded_quarantine_gets_its_quarantine_name_and_a_note(tmp_path: Path) -> None:
    store = _store(tmp_path)
    staged = _killed_after_staging(store, BAD, delete=False)
    assert [f.path for f in store.stranded(0.0)] == [str(staged)]
    [settled] = store.settle_stranded(0.0)
    assert settled.path == str(staged) and settled.into_quarantine
    assert settled.size == len(BAD)
    aside = _quarantine_dir(store) / f"{CHUNK.key.hex}.kvc"
    assert aside.read_bytes() == BAD
    note = (_quarantine_dir(store) / f"{CHUNK.key.hex}.kvc.reason").read_text()
    assert STRANDED_NOTE in note
    assert not staged.exists()
    assert [Path(f.path) for f in store.quarantined()] == [aside]
    assert store.stranded(0.0) == []


def test_a_stranded_quarantine_whose_name_is_held_goes(tmp_path: Path) -> None:
    """Quarantine keeps one copy per key: the copy already there (and its note) stays."""
    store = _store(tmp_path)
    store.put(CHUNK.key, EARLIER_BAD)
    store.quarantine(CHUNK.key, "first")
    reason = (_quarantine_dir(store) / f"{CHUNK.key.hex}.kvc.reason").read_bytes()
    staged = _killed_after_staging(store, BAD, delete=False)
    assert len(store.settle_stranded(0.0)) == 1
    assert not staged.exists()
    assert (_quarantine_dir(store) / f"{CHUNK.key.hex}.kvc").read_bytes() == EARLIER_BAD
    assert (_quarantine_dir(store) / f"{CHUNK.key.hex}.kvc.reason").read_bytes() == reason


def test_a_stranded_delete_is_deleted(tmp_path: Path) -> None:
    store = _store(tmp_path, quarantine="delete")
    staged = _killed_after_staging(store, BAD, delete=True)
    [settled] = store.settle_stranded(0.0)
    assert settled.namespace == "" and not settled.into_quarantine
    assert not staged.exists()
    assert store.quarantined() == []


@pytest.mark.parametrize("delete", [False, True])
def test_young_staged_files_are_kept(tmp_path: Path, delete: bool) -> None:
    store = _store(tmp_path)
    staged = _killed_after_staging(store, BAD, delete=delete)
    assert store.stranded(3600.0) == []
    assert store.settle_stranded() == []
    assert staged.read_bytes() == BAD
    assert store.quarantined() == []


@pytest.mark.parametrize("delete", [False, True])
def test_the_default_grace_counts_from_staging_not_the_old_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delete: bool
) -> None:
    """A chunk written a week ago and staged just now is young; two hours on, it is old."""
    store = _store(tmp_path)
    staged = _killed_after_staging(store, BAD, delete=delete)
    week_ago = time.time() - 7 * 86400
    os.utime(staged, (week_ago, week_ago))  # (moves the ctime to now, as staging did)
    assert store.settle_stranded() == []
    assert staged.exists()
    later = time.time() + 2 * 3600
    monkeypatch.setattr(time, "time", lambda: later)
    assert [f.path for f in store.settle_stranded()] == [str(staged)]
    assert not staged.exists()
    assert len(store.quarantined()) == (0 if delete else 1)


@pytest.mark.parametrize("mode", ["move", "delete"])
def test_a_sweep_during_a_set_aside_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Another process's prune/verify (the default grace) sweeps the moment the chunk is
    staged: the staged file is young by its ctime although its mtime is a week old."""
    store = _store(tmp_path, quarantine=mode)
    store.put(CHUNK.key, BAD)
    week_ago = time.time() - 7 * 86400
    os.utime(store.path_of(CHUNK.key), (week_ago, week_ago))
    [(_, ident)] = store.read_unchecked_with_idents([CHUNK.key])
    sweeper = FsStore(store.root)
    real = store.io.move
    swept: list[object] = []

    def swept_after(src: str, dst: str) -> bool:
        moved = bool(real(src, dst))
        if src == store.path_of(CHUNK.key):
            swept.append(sweeper.stranded(0.0))  # it is there, staged
            swept.append(sweeper.settle_stranded())
            swept.append(sweeper.remove_orphans())
        return moved

    monkeypatch.setattr(store.io, "move", swept_after)
    if mode == "move":
        assert store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is True
    else:
        assert store.delete_if_unchanged(CHUNK.key, ident) is True
    monkeypatch.undo()
    assert len(swept[0]) == 1  # type: ignore[arg-type]
    assert swept[1:] == [[], 0]
    expected = [BAD] if mode == "move" else []
    assert [Path(f.path).read_bytes() for f in store.quarantined()] == expected
    assert store.exists(CHUNK.key) is False
    assert store.stranded(0.0) == []


def test_unrelated_files_in_the_staging_directories_are_untouched(tmp_path: Path) -> None:
    store = _store(tmp_path)
    other = CHUNKS[1]
    store.put(other.key, BAD)
    store.quarantine(other.key, "bad")
    staged = _killed_after_staging(store, BAD, delete=False)
    qdir, state = _quarantine_dir(store), Path(store.root) / L.STATE_DIR
    state.mkdir(exist_ok=True)
    (state / "models").mkdir(exist_ok=True)
    keep = {
        qdir / f".{other.key.hex}.kvc.reason.123.0123456789ab.tmp": b"a note's temp",
        qdir / ".notes.tmp": b"x",
        qdir / f".{other.key.hex}.123.short.tmp": b"not temp_name's",
        qdir / f"{other.key.hex}.kvc.atime": b"1",
        qdir / "README": b"mine",
        state / "usage.json": b"{}",
        state / ".usage.json.123.0123456789ab.tmp": b"ledger temp",
        state / "models" / f".{other.key.hex}.123.0123456789ab.tmp": b"below models/",
        state / "lock": b"",
    }
    for path, data in keep.items():
        path.write_bytes(data)
    before = {p: p.read_bytes() for p in Path(store.root).rglob("*") if p.is_file()}
    assert [f.path for f in store.settle_stranded(0.0)] == [str(staged)]
    after = {p: p.read_bytes() for p in Path(store.root).rglob("*") if p.is_file()}
    moved = {staged, qdir / f"{CHUNK.key.hex}.kvc", qdir / f"{CHUNK.key.hex}.kvc.reason"}
    assert {p: d for p, d in before.items() if p not in moved} == {
        p: d for p, d in after.items() if p not in moved
    }


def test_a_symlinked_state_directory_is_not_swept(tmp_path: Path) -> None:
    store = _store(tmp_path, quarantine="delete")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    foreign = elsewhere / L.temp_name(CHUNK.key.hex)
    foreign.write_bytes(b"someone's")
    state = Path(store.root) / L.STATE_DIR
    if state.exists():
        for p in sorted(state.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        state.rmdir()
    state.symlink_to(elsewhere)
    assert store.stranded(0.0) == []
    assert store.settle_stranded(0.0) == []
    assert foreign.exists()


def test_fsspec_stores_list_none_for_want_of_a_ctime(tmp_path: Path) -> None:
    """fsspec reports no ctime (a memory filesystem's ``created`` is not a rename's time):
    staged files there are left to look at by hand."""
    fs = fsspec.filesystem("memory")
    root = f"/stranded-{uuid.uuid4().hex}"
    store = FsStore(root, fs=fs, create=True)
    assert isinstance(store, SupportsStagingSweep)
    store.put(CHUNK.key, BAD)
    staged = f"{root}/{L.QUARANTINE_DIR}/{CHUNK.key.namespace}/{L.temp_name(CHUNK.key.hex)}"
    fs.mv(store.path_of(CHUNK.key), staged)
    assert store.stranded(0.0) == []
    assert store.settle_stranded(0.0) == []
    assert fs.exists(staged)
