"""FsStore specifics: opening rules, layout on disk, temp files, quarantine, access times."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from chunkstore.backends._fs import FsStore, open_fs_store
from chunkstore.backends._fsio import FsspecIO, LocalIO
from chunkstore.errors import ConfigError, StoreError
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

CHUNKS = sample_chunks(4, seed=21)


def test_missing_root_is_an_error_unless_create(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such directory"):
        FsStore(str(tmp_path / "nope"))
    store = FsStore(str(tmp_path / "nope" / "deeper"), create=True)
    marker = json.loads((tmp_path / "nope" / "deeper" / "chunkstore-layout.json").read_text())
    assert marker["layout"] == 1
    assert store.root == str(tmp_path / "nope" / "deeper")


def test_foreign_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "photos").mkdir()
    for create in (False, True):
        with pytest.raises(StoreError, match="not a chunkstore directory"):
            FsStore(str(tmp_path), create=create)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        FsStore(str(tmp_path / "file"))


def test_empty_dir_gets_marker_on_first_write(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path))
    assert list(store.list()) == []
    assert not (tmp_path / "chunkstore-layout.json").exists()  # opening to read writes nothing
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    assert (tmp_path / "chunkstore-layout.json").exists()
    assert (tmp_path / CHUNKS[0].key.path).read_bytes() == CHUNKS[0].data


def test_store_without_marker_but_with_chunks_opens(tmp_path: Path) -> None:
    FsStore(str(tmp_path), create=True).put(CHUNKS[0].key, CHUNKS[0].data)
    (tmp_path / "chunkstore-layout.json").unlink()
    assert FsStore(str(tmp_path)).get(CHUNKS[0].key) == CHUNKS[0].data


def test_unknown_layout_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "chunkstore-layout.json").write_text('{"layout": 7}')
    with pytest.raises(StoreError, match="layout 7 is not supported"):
        FsStore(str(tmp_path))
    (tmp_path / "chunkstore-layout.json").write_text("garbage")
    with pytest.raises(StoreError, match="not a chunkstore layout marker"):
        FsStore(str(tmp_path))


def test_unreadable_root(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores permissions")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    try:
        with pytest.raises(StoreError):
            FsStore(str(locked / "inner"))
    finally:
        locked.chmod(0o755)


def test_open_fs_store_urls(tmp_path: Path) -> None:
    assert isinstance(open_fs_store(str(tmp_path)).io, LocalIO)
    store = open_fs_store(f"file://{tmp_path}")
    assert isinstance(store.io, LocalIO) and store.root == str(tmp_path)
    remote = open_fs_store("memory://open-fs-store-test", create=True)
    assert isinstance(remote.io, FsspecIO)
    remote.put(CHUNKS[0].key, CHUNKS[0].data)
    assert fsspec.filesystem("memory").exists(f"/open-fs-store-test/{CHUNKS[0].key.path}")
    with pytest.raises(ConfigError, match="unknown option"):
        open_fs_store(str(tmp_path), colour="blue")
    with pytest.raises(ConfigError, match="quarantine"):
        open_fs_store(str(tmp_path), quarantine="shred")
    with pytest.raises(ConfigError, match="unsupported store URL"):
        open_fs_store("nosuchproto://x")


def test_no_fixed_temp_names_and_orphans(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    leaf = tmp_path / CHUNKS[0].key.path
    assert sorted(os.listdir(leaf.parent)) == [leaf.name]
    # a writer killed mid-write leaves a temp file; it is listed, never served, removable
    orphan = leaf.parent / f".{CHUNKS[0].key.hex}.4242.abcdef.tmp"
    orphan.write_bytes(CHUNKS[0].data[:100])
    old = time.time() - 7200
    os.utime(orphan, (old, old))
    assert [o.path for o in store.orphans()] == [str(orphan)]
    assert store.orphans(older_than=3 * 3600) == []
    assert {i.key for i in store.list()} == {CHUNKS[0].key}
    assert store.remove_orphans(grace=3600) == 1
    assert not orphan.exists() and leaf.exists()


def test_foreign_files_are_listed_not_served(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    leaf = tmp_path / CHUNKS[0].key.path
    (leaf.parent / "README").write_text("x")
    misplaced = tmp_path / CHUNKS[0].key.namespace / "00" / "00" / (CHUNKS[1].key.hex + ".kvc")
    misplaced.parent.mkdir(parents=True)
    misplaced.write_bytes(CHUNKS[1].data)
    assert {os.path.basename(f.path) for f in store.foreign_files()} == {"README", misplaced.name}
    assert {i.key for i in store.list()} == {CHUNKS[0].key}


def test_a_stray_walk_stats_only_what_is_not_the_stores_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path), create=True)
    for chunk in CHUNKS[:3]:
        store.put(chunk.key, chunk.data)
    leaf = (tmp_path / CHUNKS[0].key.path).parent
    link = leaf / f"{CHUNKS[0].key.hex[:4]}{'0' * 60}.kvc"  # a chunk's name, not a file
    link.symlink_to(tmp_path / "elsewhere")
    os.mkfifo(leaf / f"{CHUNKS[0].key.hex[:4]}{'1' * 60}.kvc")
    (leaf / "README").write_text("x")
    statted: list[str] = []
    scandir = os.scandir

    class Counted:
        def __init__(self, entry: os.DirEntry[str]) -> None:
            self._entry = entry
            self.name = entry.name

        def is_file(self, *, follow_symlinks: bool = True) -> bool:
            return self._entry.is_file(follow_symlinks=follow_symlinks)

        def is_dir(self, *, follow_symlinks: bool = True) -> bool:
            return self._entry.is_dir(follow_symlinks=follow_symlinks)

        def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
            statted.append(self.name)
            return self._entry.stat(follow_symlinks=follow_symlinks)

    class Listing:
        def __init__(self, path: str) -> None:
            self._it = scandir(path)

        def __enter__(self) -> Listing:
            return self

        def __exit__(self, *exc: object) -> None:
            self._it.close()

        def __iter__(self) -> Any:
            return (Counted(entry) for entry in self._it)

    monkeypatch.setattr(os, "scandir", Listing)
    found = store.strays()
    names = {os.path.basename(f.path) for f in found.foreign}
    assert names == {link.name, "README", link.name.replace("0" * 60, "1" * 60)}
    assert sorted(statted) == sorted(names)  # never a chunk of the store
    assert found.unfinished == []


def test_quarantine_moves_aside_with_reason(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    store.put(CHUNKS[1].key, corrupt_copies(CHUNKS[1])["bitflip"])
    assert store.get(CHUNKS[1].key) is None
    moved = tmp_path / "quarantine" / CHUNKS[1].key.namespace / (CHUNKS[1].key.hex + ".kvc")
    assert moved.read_bytes() == corrupt_copies(CHUNKS[1])["bitflip"]
    assert "ChecksumMismatch" in Path(str(moved) + ".reason").read_text()
    assert [q.path for q in store.quarantined()] == [str(moved)]
    assert store.corrupt_detected == 1


def test_quarantine_delete_mode(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True, quarantine="delete")
    store.put(CHUNKS[1].key, corrupt_copies(CHUNKS[1])["truncated"])
    assert store.get(CHUNKS[1].key) is None
    assert not (tmp_path / "quarantine").exists()
    assert not (tmp_path / CHUNKS[1].key.path).exists()


def test_verify_off_returns_raw_bytes(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True, verify=False)
    bad = corrupt_copies(CHUNKS[1])["bitflip"]
    store.put(CHUNKS[1].key, bad)
    assert store.get(CHUNKS[1].key) == bad
    assert store.corrupt_detected == 0


def test_access_time_is_explicit_and_rate_limited(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True, access_resolution=3600)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    path = tmp_path / CHUNKS[0].key.path
    old = time.time() - 10 * 3600
    os.utime(path, (old, old))
    assert store.get(CHUNKS[0].key) is not None
    st = path.stat()
    assert st.st_mtime == pytest.approx(old)  # the write time is untouched
    assert st.st_atime > old + 9 * 3600  # recorded although the mount may be noatime
    first = st.st_atime
    assert store.get(CHUNKS[0].key) is not None
    assert path.stat().st_atime == first  # within the resolution: no second write
    quiet = FsStore(str(tmp_path), track_access=False)
    os.utime(path, (old, old))
    assert quiet.get(CHUNKS[0].key) is not None
    assert path.stat().st_atime == pytest.approx(old)


def test_access_record_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FsStore(str(tmp_path), create=True, access_resolution=0)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    # another user's file: utime with explicit times is refused, the store writes a record
    monkeypatch.setattr(store.io, "set_access", lambda *a: False)
    assert store.get(CHUNKS[0].key) is not None
    record = Path(str(tmp_path / CHUNKS[0].key.path) + ".atime")
    stamp = float(record.read_text())
    assert [i.atime for i in store.list()] == [pytest.approx(stamp)]
    assert store.delete(CHUNKS[0].key) and not record.exists()


def test_get_into_small_buffer_is_a_usage_error(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_into(CHUNKS[0].key, bytearray(10))
    with pytest.raises(ConfigError, match="writable"):
        store.get_into(CHUNKS[0].key, bytes(len(CHUNKS[0].data)))


def test_write_failure_is_a_store_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FsStore(str(tmp_path), create=True)

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.io, "replace", disk_full)
    with pytest.raises(StoreError, match="cannot write.*No space left"):
        store.put(CHUNKS[0].key, CHUNKS[0].data)
    leaf = (tmp_path / CHUNKS[0].key.path).parent
    assert os.listdir(leaf) == []  # the temp file was cleaned up


def test_a_directory_is_made_once_per_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    mkdir = os.mkdir

    def counted(path: str, *args: Any, **kwargs: Any) -> None:
        made.append(str(path))
        mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", counted)
    io = LocalIO()
    leaf = str(tmp_path / "ns" / "ab" / "cd")
    assert io.make_dir(leaf) is True  # made, with its parents
    assert made[0] == leaf and made[-1] == leaf
    made.clear()
    assert io.make_dir(leaf) is False  # known: no request at all
    assert made == []
    assert LocalIO().make_dir(leaf) is False  # another object finds it with one mkdir
    assert made == [leaf]
    shutil.rmtree(leaf)  # removed behind the object's back: the write makes it again
    path = io.write_temp(leaf, "t.tmp", b"x", False)
    assert Path(path).read_bytes() == b"x"


def test_a_put_into_a_removed_directory_makes_it_again(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    chunk = CHUNKS[0]
    assert store.put_if_absent(chunk.key, chunk.data)
    shutil.rmtree((tmp_path / chunk.key.path).parent)
    assert store.get(chunk.key) is None
    assert store.put_if_absent(chunk.key, chunk.data)
    assert store.get(chunk.key) == chunk.data


def test_a_put_if_absent_into_a_directory_it_made_still_refuses_a_file_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another writer's chunk lands between this put's mkdir and its publish: the put made
    # the directory, so it does not look for a file first, and the publish still refuses.
    store = FsStore(str(tmp_path), create=True)
    chunk, theirs = CHUNKS[0], CHUNKS[0].data[:-1] + bytes([CHUNKS[0].data[-1] ^ 1])
    final = tmp_path / chunk.key.path
    make_dir = store.io.make_dir

    def then_theirs(directory: str) -> bool:
        made = make_dir(directory)
        final.write_bytes(theirs)
        return made

    monkeypatch.setattr(store.io, "make_dir", then_theirs)
    assert store.put_if_absent_many([(chunk.key, chunk.data)]) == [False]
    assert final.read_bytes() == theirs
    assert [name for name in os.listdir(final.parent) if name != final.name] == []


def test_marker_appearing_between_first_look_and_listing_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A concurrent creator renames its marker into place after our first read of it."""
    FsStore(str(tmp_path / "s"), create=True).put(CHUNKS[0].key, CHUNKS[0].data)
    # leave only the marker: the other process has created the store, not yet written a chunk
    for entry in (tmp_path / "s").iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
    real = LocalIO.read_small
    seen = []

    def first_read_misses(self, path):  # type: ignore[no-untyped-def]
        if path.endswith("chunkstore-layout.json") and not seen:
            seen.append(path)
            return None  # what we saw just before the rename
        return real(self, path)

    monkeypatch.setattr(LocalIO, "read_small", first_read_misses)
    store = FsStore(str(tmp_path / "s"))
    assert seen and store.exists_many([]) == []


def test_root_made_by_another_creator_between_looks_is_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes opening one new root: the loser must see a directory, never "a file"."""
    root = tmp_path / "store"
    real_stat = os.stat
    raced = []

    def stat_then_race(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path) == str(root) and not raced:
            # the other creator's mkdir lands right after our first look found nothing
            raced.append(True)
            os.mkdir(root)
            raise FileNotFoundError(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat_then_race)
    assert LocalIO().kind(str(root)) == "dir"
    assert raced


def test_dangling_symlink_root_is_in_the_way(tmp_path: Path) -> None:
    link = tmp_path / "store"
    link.symlink_to(tmp_path / "nowhere")
    assert LocalIO().kind(str(link)) == "file"
    assert LocalIO().kind(str(tmp_path / "absent")) == "missing"
