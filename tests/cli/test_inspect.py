"""``chunkstore inspect`` over the frozen damaged store."""

from __future__ import annotations

import numpy as np

from chunkstore.backends._fs import FsStore
from chunkstore.cli.storeaccess import HEADER_PROBE_BYTES
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import make_chunks, small_spec
from tests.cli.conftest import DamagedStore, GoodStore


def test_inspect_json_counts_everything(cli, damaged: DamagedStore) -> None:
    result = cli("inspect", damaged.root, "--json")
    assert result.rc == 0
    doc = result.json()
    sizes = {i.key.hex: i.size for i in FsStore(str(damaged.root)).list()}
    assert doc["chunks"] == 16 and doc["bytes"] == sum(sizes.values())
    ns_a, ns_b = damaged.namespace("a0"), damaged.namespace("b0")
    fp_a, fp_b = damaged.manifest["fingerprints"]["a"], damaged.manifest["fingerprints"]["b"]
    by_ns = {row["namespace"]: row for row in doc["namespaces"]}
    assert by_ns[ns_a]["chunks"] == 13 and by_ns[ns_b]["chunks"] == 3
    assert by_ns[ns_a]["models"] == [fp_a] and by_ns[ns_b]["models"] == [fp_b]
    models = {row["fingerprint"]: row for row in doc["models"]}
    # model a: the chunks whose headers read fine (a0-a5, a12); model b: b0-b2
    readable_a = ("a0", "a1", "a2", "a3", "a4", "a5", "a12")
    assert models[fp_a]["chunks"] == 7
    assert models[fp_a]["bytes"] == sum(sizes[damaged.key(n)] for n in readable_a)
    assert models[fp_b]["chunks"] == 3 and models[fp_b]["namespaces"] == [ns_b]
    assert models[fp_a]["tokens_per_chunk"] == [16] and models[fp_a]["versions"] == ["1.0"]
    corrupt = {c["key"]: c["problem"].split(":")[0] for c in doc["corrupt"]}
    assert corrupt == {
        damaged.key(n): c["header_problem"]
        for n, c in damaged.manifest["chunks"].items()
        if c["header_problem"] and c["status"] == "corrupt"
    }
    assert len(corrupt) == 4
    assert {c["key"] for c in doc["unsupported"]} == {damaged.key("a7"), damaged.key("a8")}
    assert doc["orphans"]["count"] == 2 and doc["orphans"]["paths"] == damaged.manifest["temp"]
    assert doc["foreign"] == {"count": 2, "paths": damaged.manifest["foreign"]}
    assert doc["quarantined"] == 1


def test_inspect_age_histogram(cli, damaged: DamagedStore) -> None:
    doc = cli("inspect", damaged.root, "--json").json()
    hist = {row["bucket"]: (row["written"], row["used"]) for row in doc["age_histogram"]}
    # Rebased so a1's access record (day 30) is 1h old. a<i> was written on day i, b<i> on
    # day 20+i: a0 is 30d old, a1..a12 18-29d, b0..b2 8-10d; only a1 was read since.
    assert sum(w for w, _ in hist.values()) == 16 and sum(u for _, u in hist.values()) == 16
    assert hist["< 1h"] == (0, 0)
    assert hist["1h - 1d"] == (0, 1)  # a1 was read an hour ago
    assert hist["7d - 30d"][0] == 15 and hist[">= 30d"][0] == 1  # a0, written day 0


def test_inspect_table(cli, damaged: DamagedStore) -> None:
    result = cli("inspect", damaged.root)
    lines = result.out.splitlines()
    assert lines[0].startswith(f"{damaged.root}: 16 chunks, ")
    assert lines[2].split() == ["NAMESPACE", "CHUNKS", "BYTES", "MODELS"]
    fp_a = damaged.manifest["fingerprints"]["a"][:16]
    model_line = next(line for line in lines if line.startswith(fp_a))
    assert model_line.split()[1] == "7"
    assert "orphan temp files: 2 (4.0 KiB)" in lines
    assert "foreign files:     2" in lines and "quarantined:       1" in lines
    assert any(line.startswith("corrupt:           4") for line in lines)
    assert any(line.startswith("unsupported:       2") for line in lines)


def test_inspect_no_headers_skips_models_and_corrupt(cli, damaged: DamagedStore) -> None:
    doc = cli("inspect", damaged.root, "--no-headers", "--json").json()
    assert doc["chunks"] == 16 and doc["models"] is None and doc["corrupt"] is None
    assert "not checked (--no-headers)" in cli("inspect", damaged.root, "--no-headers").out


def test_inspect_changes_nothing(cli, damaged: DamagedStore) -> None:
    before = {p: p.stat().st_mtime for p in damaged.root.rglob("*")}
    atimes = {i.key: i.atime for i in FsStore(str(damaged.root)).list()}
    cli("inspect", damaged.root)
    assert {p: p.stat().st_mtime for p in damaged.root.rglob("*")} == before
    assert {i.key: i.atime for i in FsStore(str(damaged.root)).list()} == atimes


def test_inspect_namespace(cli, damaged: DamagedStore, good: GoodStore) -> None:
    doc = cli("inspect", damaged.root, "--namespace", damaged.namespace("b0"), "--json").json()
    assert doc["chunks"] == 3 and doc["corrupt"] == [] and doc["foreign"]["count"] == 1
    assert cli("inspect", good.root, "--json").json()["corrupt"] == []


def test_inspect_a_large_chunk_whose_length_prefix_is_damaged(cli, tmp_path) -> None:
    """One bit flipped high in the 8-byte header_len of a chunk larger than inspect's header
    probe: HeaderTooLarge from the probe, not a ranged read of 2**62 bytes (MemoryError)."""
    layout = ChunkLayout(small_spec(chunk_tokens=64, num_layers=2, num_kv_heads=4, head_dim=64))
    chunk = make_chunks(layout, np.arange(64, dtype=np.uint32))[0]
    assert len(chunk.data) > HEADER_PROBE_BYTES
    with FsStore(str(tmp_path), create=True) as store:
        store.put(chunk.key, chunk.data)
        path = store.path_of(chunk.key)
    with open(path, "r+b") as f:
        prefix = int.from_bytes(f.read(8), "little") | 1 << 62
        f.seek(0)
        f.write(prefix.to_bytes(8, "little"))
    result = cli("inspect", tmp_path, "--json")
    assert result.rc == 0, result.err
    assert [c["problem"].split(":")[0] for c in result.json()["corrupt"]] == ["HeaderTooLarge"]
