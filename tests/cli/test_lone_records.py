"""An access record whose chunk is gone (a capped writer's delete of a victim the capacity
index had no record noted for leaves one, spec 6.8): the filesystem store's stray walk finds
it, and ``prune``/``verify`` delete it once last used before the grace period; a dry run
only lists it, and a record whose chunk was stored again is kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

from chunkstore.backends._fs import FsStore
from chunkstore.cli.storeaccess import find_strays, remove_lone_records
from chunkstore.testing.factories import sample_chunks

CHUNKS = sample_chunks(3, seed=41)
HOUR = 3600.0


def _record(store: FsStore, index: int, *, age: float) -> Path:
    """The access record of ``CHUNKS[index]``, last used ``age`` seconds ago."""
    path = Path(store.path_of(CHUNKS[index].key) + ".atime")
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.time() - age
    path.write_text(f"{stamp:.6f}\n")
    os.utime(path, (stamp, stamp))
    return path


def _store(tmp_path: Path) -> tuple[Path, FsStore, Path, Path]:
    """A store with chunk 0 and its record, and lone records of chunks 1 (old) and 2 (young):
    (root, store, the old lone record, the young one)."""
    root = tmp_path / "s"
    store = FsStore(str(root), create=True)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    _record(store, 0, age=2 * HOUR)
    return root, store, _record(store, 1, age=2 * HOUR), _record(store, 2, age=60)


def test_the_stray_walk_finds_records_beside_no_chunk(tmp_path: Path) -> None:
    root, store, old, young = _store(tmp_path)
    leaf = Path(store.path_of(CHUNKS[0].key)).parent
    linked = leaf / f"{CHUNKS[0].key.hex[:4]}{'5' * 60}.kvc.atime"  # a record's name, a link
    linked.symlink_to(old)
    found = store.strays()
    assert sorted(f.path for f in found.lone_records) == sorted([str(old), str(young)])
    assert str(linked) in {f.path for f in found.foreign}  # not a regular file: foreign
    assert found.unfinished == []


def test_a_record_outside_its_fan_out_directory_is_not_judged(tmp_path: Path) -> None:
    root, store, old, young = _store(tmp_path)
    misplaced = old.parent / f"{'0' * 64}.kvc.atime"
    misplaced.write_text("1\n")
    assert str(misplaced) not in {f.path for f in store.strays().lone_records}


def test_prune_removes_an_old_lone_record_and_keeps_a_young_one(cli, tmp_path: Path) -> None:
    root, store, old, young = _store(tmp_path)
    doc = cli("prune", root, "--max-bytes", "1T", "--json").json()
    assert doc["lone_records_removed"] == [str(old.relative_to(root))]
    assert not old.exists() and young.exists()
    assert Path(store.path_of(CHUNKS[0].key) + ".atime").exists()  # its chunk is there
    assert store.get(CHUNKS[0].key) == CHUNKS[0].data


def test_verify_says_so_and_a_dry_run_only_lists(cli, tmp_path: Path) -> None:
    root, store, old, young = _store(tmp_path)
    dry = cli("verify", root, "--dry-run")
    assert "would remove 1 access record(s) whose chunk is gone" in dry.out
    assert old.exists()
    listed = cli("verify", root, "--dry-run", "--json").json()["lone_records_removed"]
    assert listed == [str(old.relative_to(root))] and old.exists()
    result = cli("verify", root, "--grace", "0s")
    assert result.rc == 0, result.err
    assert "removed 2 access record(s) whose chunk is gone" in result.out
    assert not old.exists() and not young.exists()


def test_a_record_whose_chunk_was_stored_again_is_kept(tmp_path: Path) -> None:
    root, store, old, young = _store(tmp_path)
    found = find_strays(store)
    store.put(CHUNKS[1].key, CHUNKS[1].data)  # a writer stores it between walk and removal
    went = remove_lone_records(store, [f for f, _ in found.lone_records])
    assert went == {str(young)}
    assert old.exists() and not young.exists()
