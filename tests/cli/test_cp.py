"""``chunkstore cp SRC DST``: verified, skip-existing copies between stores."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec

from chunkstore.backends import _registry as registry
from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import FAILURE, OK, USAGE
from chunkstore.testing.factories import sample_chunks
from tests.cli.conftest import DamagedStore, GoodStore


def _listing(root: Path) -> dict[str, int]:
    return {i.key.hex: i.size for i in FsStore(str(root)).list()}


def test_cp_copies_everything_then_skips_what_exists(cli, good: GoodStore, tmp_path) -> None:
    dst = tmp_path / "dst"
    first = cli("cp", good.root, dst, "--json")
    assert first.rc == OK
    doc = first.json()
    assert doc["copied"] == 8 and doc["skipped_existing"] == 0 and doc["not_copied"] == []
    assert doc["copied_bytes"] == 8 * 8192
    assert _listing(dst) == _listing(good.root)
    for chunk in good.chunks:
        assert (dst / chunk.key.path).read_bytes() == chunk.data
    second = cli("cp", good.root, dst)
    assert second.rc == OK
    assert "copied 0 chunks (0 B)" in second.out and "8 already present" in second.out


def test_cp_syncs_only_new_chunks(cli, good: GoodStore, tmp_path) -> None:
    dst = tmp_path / "dst"
    with FsStore(str(dst), create=True) as store:
        for chunk in good.chunks[:5]:
            store.put(chunk.key, chunk.data)
    doc = cli("cp", good.root, dst, "--json").json()
    assert doc["copied"] == 3 and doc["skipped_existing"] == 5
    assert _listing(dst) == _listing(good.root)


def test_cp_does_not_copy_damaged_chunks_or_touch_the_source(
    cli, damaged: DamagedStore, tmp_path
) -> None:
    before = sorted(p.relative_to(damaged.root) for p in damaged.root.rglob("*"))
    dst = tmp_path / "dst"
    result = cli("cp", damaged.root, dst, "--json")
    assert result.rc == FAILURE  # corrupt chunks found in the source
    doc = result.json()
    assert doc["copied"] == 8
    statuses = {c["key"]: c["status"] for c in doc["not_copied"]}
    assert statuses == {
        damaged.key(n): c["status"]
        for n, c in damaged.manifest["chunks"].items()
        if c["status"] != "ok"
    }
    assert set(_listing(dst)) == {damaged.key(n) for n in damaged.names("ok")}
    assert sorted(p.relative_to(damaged.root) for p in damaged.root.rglob("*")) == before


def test_cp_namespace_filter(cli, damaged: DamagedStore, tmp_path) -> None:
    dst = tmp_path / "dst"
    result = cli("cp", damaged.root, dst, "--namespace", damaged.namespace("b0"), "--json")
    assert result.rc == OK and result.json()["copied"] == 3
    assert set(_listing(dst)) == {damaged.key(n) for n in ("b0", "b1", "b2")}


def open_fsspec_memory_store(url: str, **options: Any) -> FsStore:
    """A filesystem store on fsspec's in-memory filesystem (a non-local fsspec store)."""
    return FsStore(url.split("://", 1)[1], fs=fsspec.filesystem("memory"), **options)


def test_cp_to_and_from_a_non_local_fsspec_store(
    cli, good: GoodStore, tmp_path, monkeypatch
) -> None:
    # memory:// itself opens a per-process MemoryStore, so route a test scheme to FsStore
    # over fsspec's memory filesystem: the FsspecIO code path, not the local fast path.
    monkeypatch.setitem(registry._SCHEMES, "fsmem", (__name__, "open_fsspec_memory_store", ""))
    url = f"fsmem:///{tmp_path.name}/cp-target"
    to = cli("cp", good.root, url, "--dst-option", "create=true", "--json")
    assert to.rc == OK and to.json()["copied"] == 8
    assert cli("ls", url, "--json").json()["count"] == 8
    back = tmp_path / "back"
    doc = cli("cp", url, back, "--json").json()
    assert doc["copied"] == 8
    assert _listing(back) == _listing(good.root)
    fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)


def test_memory_urls_are_refused(cli, good: GoodStore) -> None:
    result = cli("cp", good.root, "memory://")
    assert result.rc == USAGE and "memory:// stores live inside one process" in result.err
    assert cli("ls", "memory://").rc == USAGE


def test_cp_same_store_and_bad_batch_are_usage_errors(cli, good: GoodStore) -> None:
    same = cli("cp", good.root, f"file://{good.root}")
    assert same.rc == USAGE and "same store" in same.err
    assert cli("cp", good.root, str(good.root) + "-x", "--batch", "0").rc == USAGE


def test_cp_missing_source_is_an_error_and_creates_nothing(cli, tmp_path) -> None:
    result = cli("cp", tmp_path / "nope", tmp_path / "dst")
    assert result.rc == 4 and "no such store directory" in result.err
    assert not (tmp_path / "nope").exists()


def test_cp_batches_of_one(cli, tmp_path) -> None:
    src = tmp_path / "src"
    with FsStore(str(src), create=True) as store:
        for chunk in sample_chunks(5, seed=3):
            store.put(chunk.key, chunk.data)
    doc = cli("cp", src, tmp_path / "dst", "--batch", "1", "--json").json()
    assert doc["copied"] == 5 and _listing(tmp_path / "dst") == _listing(src)


def test_cp_counts_chunks_refused_by_the_destination_and_fails(cli, tmp_path) -> None:
    src = tmp_path / "src"
    chunks = sample_chunks(3, seed=9)
    with FsStore(str(src), create=True) as store:
        for c in chunks:
            store.put(c.key, c.data)
    dst = tmp_path / "dst"
    result = cli("cp", src, dst, "--dst-option", "max_bytes=1K", "--json")
    assert result.rc == FAILURE  # every chunk is bigger than DST's cap
    doc = result.json()
    assert doc["refused"] == 3 and doc["copied"] == 0 and doc["skipped_existing"] == 0
    assert list(FsStore(str(dst)).list()) == []
    text = cli("cp", src, dst, "--dst-option", "max_bytes=1K")
    assert text.rc == FAILURE and "3 not stored (refused by DST)" in text.out
