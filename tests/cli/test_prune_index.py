"""``prune`` and ``verify`` with a capacity index: eviction through it, reconcile, shards."""

from __future__ import annotations

import os
import time
from pathlib import Path

from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import USAGE
from chunkstore.testing.factories import sample_chunks

CHUNKS = sample_chunks(12, seed=23)
SIZE = len(CHUNKS[0].data)


def _store(root: Path) -> str:
    """A store of CHUNKS, each last used a second after the one before (set, not slept: a
    file's times tick coarser than a put takes)."""
    store = FsStore(str(root), create=True)
    start = time.time() - 100
    for i, chunk in enumerate(CHUNKS):
        store.put(chunk.key, chunk.data)
        os.utime(store.path_of(chunk.key), (start + i, start + i))
    return str(root)


def test_reconcile_fills_the_index_then_prune_evicts_through_it(
    cli, tmp_path: Path, redis_url: str
) -> None:
    root = _store(tmp_path / "s")
    index = f"index={redis_url}"
    result = cli("prune", root, "-o", index, "--reconcile", "--json")
    assert result.rc == 0, result.err
    doc = result.json()
    assert doc["reconciled"] == {"walked": 12, "added": 12, "removed": 0}
    assert (doc["chunks_after"], doc["bytes_after"]) == (12, 12 * SIZE)
    result = cli("prune", root, "-o", index, "--max-bytes", str(8 * SIZE), "--json")
    assert result.rc == 0, result.err
    assert result.json()["removed"] == 4 and result.json()["chunks_after"] == 8
    left = {i.key for i in FsStore(root).list()}
    assert left == {c.key for c in CHUNKS[4:]}  # the four written first went
    result = cli("prune", root, "-o", index, "--older-than", "1h")
    assert result.rc == 0 and "evicted 0 chunks through the index" in result.out


def test_sharded_reconciles_and_verify_cover_the_store_once(
    cli, tmp_path: Path, redis_url: str
) -> None:
    root = _store(tmp_path / "s")
    index = f"index={redis_url}"
    walked = verified = 0
    for shard in range(3):
        result = cli("prune", root, "-o", index, "--reconcile", "--shard", f"{shard}/3", "--json")
        assert result.rc == 0, result.err
        walked += result.json()["reconciled"]["walked"]
        result = cli("verify", root, "--shard", f"{shard}/3", "--json")
        assert result.rc == 0, result.err
        verified += result.json()["ok"]
    assert walked == verified == 12


def test_bad_shards_and_flags_are_one_line_errors(cli, tmp_path: Path, redis_url: str) -> None:
    root = _store(tmp_path / "s")
    for args in (
        ("prune", root, "--reconcile", "--shard", "3/3"),
        ("prune", root, "--max-bytes", "1M", "--shard", "0/2"),
        ("prune", root, "--reconcile"),
        ("verify", root, "--shard", "a/b"),
    ):
        result = cli(*args)
        assert result.rc == USAGE, (args, result.out, result.err)
        last = result.err.strip().splitlines()[-1]
        assert last.startswith("chunkstore ") and "Traceback" not in result.err


def _orphans_and_foreign(root: Path) -> tuple[set[str], str]:
    """An orphan temp file, two hours old, beside each chunk of ``root``, and one foreign
    file; their paths relative to the root."""
    from chunkstore.backends import _layout as L

    old = time.time() - 7200
    orphans = set()
    for chunk in CHUNKS:
        leaf = (root / chunk.key.path).parent
        orphan = leaf / L.temp_name(chunk.key.hex)
        orphan.write_bytes(b"partial")
        os.utime(orphan, (old, old))
        orphans.add(str(orphan.relative_to(root)))
    readme = (root / CHUNKS[0].key.path).parent / "README"
    readme.write_text("not a chunk")
    return orphans, str(readme.relative_to(root))


def test_sharded_reconciles_sweep_each_orphan_once(cli, tmp_path: Path, redis_url: str) -> None:
    root = _store(tmp_path / "s")
    orphans, readme = _orphans_and_foreign(Path(root))
    index = f"index={redis_url}"
    removed: list[str] = []
    foreign: list[str] = []
    for shard in range(3):
        result = cli("prune", root, "-o", index, "--reconcile", "--shard", f"{shard}/3", "--json")
        assert result.rc == 0, result.err
        removed += result.json()["orphans_removed"]
        foreign += result.json()["foreign"]
    assert sorted(removed) == sorted(orphans)  # each once, by the shard of its directory
    assert foreign == [readme]
    assert not [p for p in Path(root).rglob("*") if str(p.relative_to(root)) in orphans]


def test_a_sharded_verify_sweeps_its_own_directories(cli, tmp_path: Path) -> None:
    from chunkstore.backends._index import shard_of

    root = _store(tmp_path / "s")
    orphans, _ = _orphans_and_foreign(Path(root))
    result = cli("verify", root, "--shard", "1/2", "--json")
    assert result.rc == 0, result.err
    swept = result.json()["orphans_removed"]
    assert swept and sorted(swept) == sorted(o for o in orphans if shard_of(o, 2) == 1)
