"""``chunkstore show``: header, tensor table, tokens, checksum and key checks."""

from __future__ import annotations

import os
import shutil

from chunkstore.cli.exitcodes import BAD_CHUNK, FAILURE, STORE_UNAVAILABLE, USAGE
from chunkstore.format import decode_chunk
from tests.cli.conftest import DamagedStore, GoodStore, run_process


def _field(out: str, name: str) -> str:
    for line in out.splitlines():
        if line.startswith(name + ":"):
            return line[len(name) + 1 :].strip()
    raise AssertionError(f"no {name!r} line in:\n{out}")


def test_show_file_prints_header_tensors_tokens_and_checks(cli, good: GoodStore) -> None:
    chunk = good.chunks[3]
    header = decode_chunk(chunk.data).header
    result = cli("show", good.root / chunk.key.path)
    assert result.rc == 0, result.err
    out = result.out
    assert _field(out, "key") == chunk.key.hex
    assert _field(out, "parent") == chunk.parent.hex()
    assert _field(out, "namespace") == chunk.key.namespace
    assert _field(out, "fingerprint") == header.fingerprint.hex()
    assert _field(out, "format") == "1.0"
    assert _field(out, "checksum") == f"xxh3-128:{header.checksum.hex()}  ok"
    assert _field(out, "key derivation").startswith("ok")
    assert _field(out, "key expected").startswith("ok")
    assert _field(out, "verdict") == "OK"
    lines = out.splitlines()
    start = lines.index("tensors (4):")
    assert lines[start + 1].split() == ["NAME", "DTYPE", "SHAPE", "OFFSET", "BYTES"]
    assert lines[start + 2].split() == ["layers.0.k", "BF16", "4x16x8", "0", "1024"]
    tokens_at = lines.index("tokens (16):")
    shown = [int(t) for t in lines[tokens_at + 1].split()]
    assert shown == [int(t) for t in chunk.tokens]


def test_show_by_key_prefix_and_namespaced_key(cli, good: GoodStore) -> None:
    chunk = good.chunks[5]
    by_prefix = cli("show", good.root, chunk.key.hex[:10], "--json")
    assert by_prefix.rc == 0
    doc = by_prefix.json()
    assert doc["header"]["key"] == chunk.key.hex
    assert doc["tokens"] == [int(t) for t in chunk.tokens]
    assert doc["checks"] == {
        "payload": "ok",
        "checksum": "ok",
        "key_derivation": True,
        "key_expected": True,
        "namespace_expected": True,
    }
    assert doc["ok"] is True
    assert [t["name"] for t in doc["tensors"]] == [
        "layers.0.k",
        "layers.0.v",
        "layers.1.k",
        "layers.1.v",
    ]
    full = cli("show", good.root, f"{chunk.key.namespace}/{chunk.key.hex}", "--json").json()
    assert full["header"] == doc["header"]


def test_show_unknown_and_bad_keys(cli, good: GoodStore) -> None:
    present = {c.key.hex[:4] for c in good.chunks}
    absent = next(f"{i:04x}" for i in range(65536) if f"{i:04x}" not in present)
    missing = cli("show", good.root, absent)
    assert missing.rc == STORE_UNAVAILABLE and "no chunk with key" in missing.err
    bad = cli("show", good.root, "xyz")
    assert bad.rc == USAGE and "not a chunk key" in bad.err


def test_show_ambiguous_key_across_namespaces(cli, good: GoodStore) -> None:
    chunk = good.chunks[0]
    twin = good.root / ("f" * 16) / chunk.key.path.split("/", 1)[1]
    twin.parent.mkdir(parents=True)
    shutil.copy(good.root / chunk.key.path, twin)
    result = cli("show", good.root, chunk.key.hex[:12])
    assert result.rc == USAGE and "ambiguous (2 chunks" in result.err
    picked = cli("show", good.root, f"{chunk.key.namespace}/{chunk.key.hex}", "--json")
    assert picked.rc == 0 and picked.json()["header"]["namespace"] == chunk.key.namespace
    # the twin is a valid chunk stored under a namespace it does not belong to
    misplaced = cli("show", good.root, f"{'f' * 16}/{chunk.key.hex}", "--json")
    assert misplaced.rc == FAILURE
    assert misplaced.json()["checks"]["namespace_expected"] is False
    as_file = cli("show", twin)
    assert as_file.rc == FAILURE
    assert _field(as_file.out, "namespace check").startswith("FAILED")


def test_show_bit_flipped_chunk_reports_checksum_mismatch(cli, damaged: DamagedStore) -> None:
    result = cli("show", damaged.path("a4"))
    assert result.rc == FAILURE
    assert _field(result.out, "checksum").endswith("MISMATCH")
    assert _field(result.out, "key derivation").startswith("ok")
    assert _field(result.out, "verdict") == "DAMAGED"


def test_show_renamed_chunk_fails_expected_key(cli, damaged: DamagedStore) -> None:
    doc = cli("show", damaged.path("a9"), "--json").json()
    assert doc["checks"]["checksum"] == "ok"
    assert doc["checks"]["key_derivation"] is True
    assert doc["checks"]["key_expected"] is False  # holds a0's key under a9's name
    assert doc["header"]["key"] == damaged.key("a0")
    assert doc["ok"] is False


def test_show_truncated_payload_and_compressed(cli, damaged: DamagedStore) -> None:
    cut = cli("show", damaged.path("a5"), "--json")
    assert cut.rc == FAILURE
    assert cut.json()["checks"]["payload"].startswith("TruncatedChunk")
    assert cut.json()["checks"]["checksum"] == "not checked (TruncatedChunk)"
    zstd = cli("show", damaged.path("a12"), "--json")
    assert zstd.rc == 0 and zstd.json()["header"]["compression"] == "zstd"


def test_show_file_without_a_key_name(cli, good: GoodStore, tmp_path) -> None:
    copy = tmp_path / "some-chunk.bin"
    shutil.copy(good.root / good.chunks[0].key.path, copy)
    doc = cli("show", copy, "--json").json()
    assert doc["checks"]["key_expected"] is None and doc["ok"] is True


def test_show_not_a_chunk_and_unsupported_version(cli, damaged: DamagedStore, tmp_path) -> None:
    garbage = cli("show", damaged.path("a10"))
    assert garbage.rc == BAD_CHUNK
    assert garbage.err.count("\n") == 1 and "BadMagic" not in garbage.err
    assert str(damaged.path("a10")) in garbage.err and "not a chunkstore chunk" in garbage.err
    future = cli("show", damaged.path("a7"))
    assert future.rc == BAD_CHUNK and "version 2.0 is not supported" in future.err
    assert cli("show", tmp_path / "nope.kvc").rc == STORE_UNAVAILABLE
    assert cli("show", tmp_path).rc == USAGE


def test_show_refuses_files_that_are_not_regular(cli, tmp_path) -> None:
    """/dev/zero was read until memory ran out, a FIFO until a writer came (forever)."""
    device = cli("show", "/dev/null")
    assert device.rc == STORE_UNAVAILABLE
    assert device.err.count("\n") == 1 and "/dev/null: not a regular file" in device.err
    fifo = tmp_path / "pipe.kvc"
    os.mkfifo(fifo)
    proc = run_process("show", fifo)
    assert proc.returncode == STORE_UNAVAILABLE
    assert proc.stderr.count("\n") == 1 and "not a regular file" in proc.stderr
