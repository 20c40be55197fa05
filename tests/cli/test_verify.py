"""``chunkstore verify`` over the frozen damaged store."""

from __future__ import annotations

import os
import time

from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import FAILURE, OK
from tests.cli.conftest import DamagedStore, GoodStore

CORRUPT = {"a4", "a5", "a6", "a9", "a10", "a11"}
UNSUPPORTED = {"a7", "a8"}


def _keys(damaged: DamagedStore, names: set[str]) -> set[str]:
    return {damaged.key(n) for n in names}


def test_verify_clean_store_exits_zero(cli, good: GoodStore) -> None:
    result = cli("verify", good.root)
    assert result.rc == OK
    assert "verified 8 chunks" in result.out and "8 ok (64.0 KiB), 0 corrupt" in result.out


def test_verify_quarantines_exactly_the_corrupt_chunks(cli, damaged: DamagedStore) -> None:
    assert damaged.names("corrupt") == CORRUPT and damaged.names("unsupported") == UNSUPPORTED
    result = cli("verify", damaged.root, "--json")
    assert result.rc == FAILURE
    doc = result.json()
    assert doc["checked"] == 16 and doc["ok"] == 8
    problems = {c["key"]: c["problem"].split(":")[0] for c in doc["corrupt"]}
    assert problems == {damaged.key(n): damaged.manifest["chunks"][n]["problem"] for n in CORRUPT}
    assert {c["action"] for c in doc["corrupt"]} == {"quarantined"}
    assert {c["key"] for c in doc["unsupported"]} == _keys(damaged, UNSUPPORTED)
    assert {c["action"] for c in doc["unsupported"]} == {"left (unsupported version)"}
    # on disk: corrupt ones moved to quarantine, everything else where it was
    for name in CORRUPT:
        assert not damaged.path(name).exists()
        moved = damaged.root / "quarantine" / damaged.namespace(name) / f"{damaged.key(name)}.kvc"
        assert moved.exists()
    for name in damaged.names("ok") | UNSUPPORTED:
        assert damaged.path(name).exists()
    # a second run finds nothing new and exits 0
    again = cli("verify", damaged.root, "--json")
    assert again.rc == OK
    assert again.json()["corrupt"] == [] and again.json()["quarantined"] == 1 + len(CORRUPT)


def test_verify_delete_removes_corrupt_chunks(cli, damaged: DamagedStore) -> None:
    result = cli("verify", damaged.root, "--delete", "--json")
    assert result.rc == FAILURE
    assert {c["action"] for c in result.json()["corrupt"]} == {"deleted"}
    for name in CORRUPT:
        assert not damaged.path(name).exists()
    assert (
        not (damaged.root / "quarantine" / damaged.namespace("a4"))
        .joinpath(f"{damaged.key('a4')}.kvc")
        .exists()
    )
    assert sorted(i.key.hex for i in FsStore(str(damaged.root)).list()) == sorted(
        _keys(damaged, damaged.names("ok") | UNSUPPORTED)
    )


def test_verify_dry_run_changes_nothing(cli, damaged: DamagedStore) -> None:
    before = sorted(p.relative_to(damaged.root) for p in damaged.root.rglob("*"))
    result = cli("verify", damaged.root, "--dry-run")
    assert result.rc == FAILURE
    assert sorted(p.relative_to(damaged.root) for p in damaged.root.rglob("*")) == before
    assert "6 corrupt, 2 unsupported" in result.out
    assert "would remove 2 orphan temp file(s)" in result.out
    lines = result.out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "KEY", "SIZE", "PROBLEM", "ACTION"]
    flipped = next(line for line in lines if damaged.key("a4")[:16] in line)
    assert "ChecksumMismatch" in flipped and "left (dry run)" in flipped


def test_verify_removes_old_orphans_and_keeps_young_ones(cli, damaged: DamagedStore) -> None:
    young, old = (damaged.root / p for p in damaged.manifest["temp"])
    now = time.time()
    os.utime(young, (now - 60, now - 60))  # a write possibly still in progress
    doc = cli("verify", damaged.root, "--json").json()
    assert doc["orphans_removed"] == [damaged.manifest["temp"][1]]
    assert doc["temp_in_grace"] == [damaged.manifest["temp"][0]]
    assert young.exists() and not old.exists()
    # with a grace shorter than its age, the young one goes too
    doc = cli("verify", damaged.root, "--grace", "30s", "--json").json()
    assert doc["orphans_removed"] == [damaged.manifest["temp"][0]] and not young.exists()


def test_verify_reports_and_never_touches_foreign_files(cli, damaged: DamagedStore) -> None:
    doc = cli("verify", damaged.root, "--json").json()
    assert doc["foreign"] == damaged.manifest["foreign"]
    for path in damaged.manifest["foreign"]:
        assert (damaged.root / path).exists()


def test_verify_does_not_count_as_use(cli, good: GoodStore) -> None:
    before = {i.key: i.atime for i in FsStore(str(good.root)).list()}
    assert cli("verify", good.root).rc == OK
    after = {i.key: i.atime for i in FsStore(str(good.root)).list()}
    assert after == before


def test_verify_namespace_filter(cli, damaged: DamagedStore) -> None:
    doc = cli("verify", damaged.root, "--namespace", damaged.namespace("b0"), "--json")
    assert doc.rc == OK
    assert doc.json()["checked"] == 3 and doc.json()["ok"] == 3
    assert damaged.path("a4").exists()


def test_verify_small_batches_same_result(cli, damaged: DamagedStore) -> None:
    doc = cli("verify", damaged.root, "--dry-run", "--batch", "1", "--json").json()
    assert doc["checked"] == 16 and len(doc["corrupt"]) == 6
