"""``chunkstore prune``: by size (LRU), by idle age, by namespace; dry runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import STORE_UNAVAILABLE, USAGE
from chunkstore.testing.factories import sample_chunks
from tests.cli.conftest import DAY, DamagedStore, GoodStore
from tests.cli.faults import EACCES, fail_on_path

PRUNE_CHUNKS = sample_chunks(4, seed=17)


def _remaining(root) -> set[str]:
    return {i.key.hex for i in FsStore(str(root)).list()}


def test_max_bytes_removes_least_recently_used_first(cli, good: GoodStore) -> None:
    # chunk 0 is the oldest write but was read a minute ago: it must survive
    good.set_times(0, written_ago=9 * DAY, used_ago=60)
    result = cli("prune", good.root, "--max-bytes", "40K", "--json")
    assert result.rc == 0
    doc = result.json()
    gone = [c["key"] for c in doc["chunks"]]
    assert gone == [good.chunks[i].key.hex for i in (1, 2, 3)]  # LRU order
    assert {c["reason"] for c in doc["chunks"]} == {"max-bytes"}
    assert doc["removed"] == 3 and doc["bytes_before"] == 8 * 8192
    assert doc["bytes_after"] == 5 * 8192 <= 40 * 1024
    assert _remaining(good.root) == {good.chunks[i].key.hex for i in (0, 4, 5, 6, 7)}


def test_max_bytes_already_under_removes_nothing(cli, good: GoodStore) -> None:
    result = cli("prune", good.root, "--max-bytes", "1G")
    assert result.rc == 0
    assert result.out.startswith("removed 0 of 8 chunks, 0 B: 64.0 KiB -> 64.0 KiB")
    assert len(_remaining(good.root)) == 8


def test_older_than_uses_last_use_not_write_time(cli, good: GoodStore) -> None:
    good.set_times(1, written_ago=7 * DAY, used_ago=2 * DAY)  # read recently: kept
    doc = cli("prune", good.root, "--older-than", "5d", "--json").json()
    # chunks 0..3 were used 8, 7(->2), 6, 5 days ago
    assert [c["key"] for c in doc["chunks"]] == [good.chunks[i].key.hex for i in (0, 2, 3)]
    assert {c["reason"] for c in doc["chunks"]} == {"older-than"}
    assert _remaining(good.root) == {good.chunks[i].key.hex for i in (1, 4, 5, 6, 7)}


def test_older_than_and_max_bytes_combine(cli, good: GoodStore) -> None:
    doc = cli("prune", good.root, "--older-than", "6d12h", "--max-bytes", "24K", "--json").json()
    reasons = [(c["key"], c["reason"]) for c in doc["chunks"]]
    expected = [(good.chunks[0].key.hex, "older-than"), (good.chunks[1].key.hex, "older-than")]
    expected += [(good.chunks[i].key.hex, "max-bytes") for i in (2, 3, 4)]
    assert reasons == expected
    assert _remaining(good.root) == {good.chunks[i].key.hex for i in (5, 6, 7)}


def test_dry_run_prints_plan_and_removes_nothing(cli, good: GoodStore) -> None:
    result = cli("prune", good.root, "--max-bytes", "50K", "--dry-run")
    assert result.rc == 0
    lines = result.out.splitlines()
    assert lines[0].split() == ["NAMESPACE", "KEY", "SIZE", "USED", "REASON"]
    assert lines[1].split()[1] == good.chunks[0].key.hex[:16]
    assert lines[1].split()[-1] == "max-bytes"
    assert "would remove 2 of 8 chunks, 16.0 KiB: 64.0 KiB -> 48.0 KiB" in result.out
    assert len(_remaining(good.root)) == 8


def test_namespace_alone_removes_that_namespace_only(cli, damaged: DamagedStore) -> None:
    ns_b = damaged.namespace("b0")
    doc = cli("prune", damaged.root, "--namespace", ns_b, "--json").json()
    assert {c["key"] for c in doc["chunks"]} == {damaged.key(n) for n in ("b0", "b1", "b2")}
    assert {c["reason"] for c in doc["chunks"]} == {"namespace"}
    left = _remaining(damaged.root)
    assert not left & {damaged.key(n) for n in ("b0", "b1", "b2")}
    assert len(left) == 13  # every chunk of the other namespace, damaged or not


def test_namespace_limits_max_bytes(cli, damaged: DamagedStore) -> None:
    ns_a = damaged.namespace("a0")
    doc = cli("prune", damaged.root, "--namespace", ns_a, "--max-bytes", "0", "--json").json()
    assert doc["considered"] == 13 and doc["removed"] == 13 and doc["bytes_after"] == 0
    assert _remaining(damaged.root) == {damaged.key(n) for n in ("b0", "b1", "b2")}


def test_prune_respects_access_records(cli, damaged: DamagedStore) -> None:
    # a1 is old by write time but its access record says it was read last of all
    doc = cli("prune", damaged.root, "--older-than", "2d", "--dry-run", "--json").json()
    planned = {c["key"] for c in doc["chunks"]}
    assert damaged.key("a1") not in planned
    assert damaged.key("a0") in planned and damaged.key("a12") in planned


def test_prune_sweeps_old_orphans_and_leaves_foreign(cli, damaged: DamagedStore) -> None:
    doc = cli("prune", damaged.root, "--max-bytes", "1T", "--json").json()
    assert doc["removed"] == 0
    assert doc["orphans_removed"] == damaged.manifest["temp"]
    assert doc["foreign"] == damaged.manifest["foreign"]
    for path in damaged.manifest["temp"]:
        assert not (damaged.root / path).exists()
    for path in damaged.manifest["foreign"]:
        assert (damaged.root / path).exists()


def test_prune_dry_run_keeps_orphans(cli, damaged: DamagedStore) -> None:
    result = cli("prune", damaged.root, "--older-than", "1000d", "--dry-run")
    assert "would remove 2 orphan temp file(s)" in result.out
    for path in damaged.manifest["temp"]:
        assert (damaged.root / path).exists()


def test_prune_needs_a_criterion_and_valid_units(cli, good: GoodStore) -> None:
    none = cli("prune", good.root)
    assert none.rc == USAGE and "needs at least one of" in none.err
    assert cli("prune", good.root, "--max-bytes", "lots").rc == USAGE
    assert cli("prune", good.root, "--older-than", "7y").rc == USAGE
    assert len(_remaining(good.root)) == 8


def test_prune_long_dry_run_is_truncated_but_json_lists_all(cli, tmp_path) -> None:
    root = tmp_path / "many"
    with FsStore(str(root), create=True) as store:
        for chunk in sample_chunks(25):
            store.put(chunk.key, chunk.data)
    lines = cli("prune", root, "--max-bytes", "0", "--dry-run").out.splitlines()
    assert len(lines) == 1 + 20 + 3  # header, 20 rows, "... and 5 more", blank, summary
    assert lines[21] == "... and 5 more (--json lists all)"
    assert lines[-1] == "would remove 25 of 25 chunks, 200.0 KiB: 200.0 KiB -> 0 B"
    doc = cli("prune", root, "--max-bytes", "0", "--dry-run", "--json").json()
    assert len(doc["chunks"]) == 25 and doc["removed"] == 0
    assert len(_remaining(root)) == 25


def test_cli_prune_permission_error_is_one_line(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "s"
    with FsStore(str(root), create=True) as store:
        for i in range(4):
            store.put(PRUNE_CHUNKS[i].key, PRUNE_CHUNKS[i].data)
        locked = store.path_of(PRUNE_CHUNKS[2].key)
    fail_on_path(monkeypatch, "remove", locked, EACCES)
    result = cli("prune", root, "--max-bytes", "0", "-q")
    assert result.rc == STORE_UNAVAILABLE
    assert "cannot delete" in result.err and locked in result.err
    assert "Traceback" not in result.err
