"""``chunkstore ls``."""

from __future__ import annotations

from tests.cli.conftest import DAY, GoodStore


def test_ls_table_lists_every_chunk_with_size_and_ages(cli, good: GoodStore) -> None:
    result = cli("ls", good.root)
    assert result.rc == 0
    lines = result.out.splitlines()
    assert lines[0].split() == ["KEY", "NAMESPACE", "SIZE", "AGE", "USED"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {c.key.hex for c in good.chunks}
    oldest = rows[good.chunks[0].key.hex].split()
    assert oldest[1] == good.chunks[0].key.namespace
    assert oldest[2:4] == ["8.0", "KiB"]
    assert oldest[4:6] == ["1w", "1d"]  # written 8 days ago
    assert lines[-1] == "8 chunks, 64.0 KiB"


def test_ls_json_sort_and_limit(cli, good: GoodStore) -> None:
    doc = cli("ls", good.root, "--json", "--sort", "used", "--limit", "3").json()
    assert doc["count"] == 8 and doc["bytes"] == 8 * 8192
    assert [c["key"] for c in doc["chunks"]] == [c.key.hex for c in good.chunks[:3]]
    first = doc["chunks"][0]
    assert set(first) == {"key", "namespace", "size", "mtime", "atime"}
    assert first["size"] == 8192 and abs(first["atime"] - first["mtime"]) < 1


def test_ls_sort_by_key_is_namespace_then_hex(cli, good: GoodStore) -> None:
    doc = cli("ls", good.root, "--json").json()
    assert [c["key"] for c in doc["chunks"]] == sorted(c.key.hex for c in good.chunks)


def test_ls_namespace_filter(cli, good: GoodStore) -> None:
    ns = good.chunks[0].key.namespace
    assert cli("ls", good.root, "--namespace", ns, "--json").json()["count"] == 8
    other = "0" * 16 if ns != "0" * 16 else "1" * 16
    result = cli("ls", good.root, "--namespace", other)
    assert result.rc == 0 and result.out.strip() == "0 chunks, 0 B"


def test_ls_limit_says_how_many_shown(cli, good: GoodStore) -> None:
    result = cli("ls", good.root, "--limit", "2")
    assert result.out.splitlines()[-1] == "8 chunks, 64.0 KiB (showing 2)"
    assert len(result.out.splitlines()) == 4


def test_ls_used_column_reflects_reads(cli, good: GoodStore) -> None:
    good.set_times(0, written_ago=10 * DAY, used_ago=60)
    doc = cli("ls", good.root, "--json", "--sort", "used").json()
    assert doc["chunks"][-1]["key"] == good.chunks[0].key.hex
