"""Two real vLLM engines (CPU, tiny random Llama) and one node service.

Engine B's first request for the prefix engine A computed is served from the
service's host memory (no tier read) with A's greedy tokens; after the service
is killed with SIGKILL, B keeps answering with the same tokens (recomputing).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from chunkstore.vllm.testing import sample_prompt_ids  # noqa: E402
from tests.node.conftest import ENGINE_START_S, Child, engine_chunk_size, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm_kernels]

PROMPT = sample_prompt_ids(300, seed=21)  # 4 chunks of 64 tokens


def _reads(metrics_url: str) -> tuple[float, float]:
    """(host hits, secondary-tier reads: hits and misses) of the service, from /metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    host = tiers = 0.0
    for line in text.splitlines():
        if line.startswith(("chunkstore_cache_hits_total{", "chunkstore_cache_misses_total{")):
            value = float(line.rsplit(" ", 1)[1])
            if 'tier="host"' not in line:
                tiers += value
            elif line.startswith("chunkstore_cache_hits_total{"):
                host += value
    return host, tiers


def _engine(model: Path, socket: Path, work: Path, name: str, *pause: Path) -> Child:
    prompts = work / f"{name}-prompts.json"
    prompts.write_text(json.dumps([PROMPT]))
    return Child(
        [
            sys.executable,
            "-m",
            "tests.node.engine_node",
            str(model),
            str(socket),
            str(prompts),
            str(work / f"{name}.json"),
            *map(str, pause),
        ]
    )


def test_engine_b_hits_what_engine_a_computed_and_survives_the_service(
    tiny_model: Path, tmp_path: Path
) -> None:
    socket = tmp_path / "node.sock"
    tier = tmp_path / "tier"
    service = Child(
        [
            sys.executable,
            "-m",
            "chunkstore.cli.main",
            "serve",
            "--slot-size",
            str(engine_chunk_size(tiny_model)),
            "--host-cache",
            "64M",
            "--store",
            str(tier),
            "--create",
            "--metrics-port",
            "0",
            "--node",
            str(socket),
        ]
    )
    engine_b: Child | None = None
    try:
        metrics_url = ""
        while not (line := service.line()).startswith("serving:"):
            if line.startswith("metrics: "):
                metrics_url = line.removeprefix("metrics: ")
        engine_a = _engine(tiny_model, socket, tmp_path, "a")
        assert engine_a.proc.wait(timeout=600) == 0
        a = json.loads((tmp_path / "a.json").read_text())["first"][0]
        assert a["metrics"]["vllm:chunkstore_saved_chunks"] == 4
        host_before, tiers_before = _reads(metrics_url)

        pause = tmp_path / "pause"
        pause.mkdir()
        engine_b = _engine(tiny_model, socket, tmp_path, "b", pause)
        # Engine B's first request comes after its whole start-up, as slow as engine A's.
        wait_until(lambda: (pause / "paused").exists(), "engine B's first request", ENGINE_START_S)
        host_after, tiers_after = _reads(metrics_url)
        assert tiers_after == tiers_before  # served from host memory only: no tier read
        assert host_after >= host_before + 4
        service.kill()
        (pause / "go").write_text("")
        assert engine_b.proc.wait(timeout=600) == 0
        b = json.loads((tmp_path / "b.json").read_text())
        first, after = b["first"][0], b["after"][0]
        assert first["tokens"] == a["tokens"]
        assert first["metrics"]["vllm:external_prefix_cache_hits"] == 256
        assert first["metrics"].get("cached_by_source:host") == 256
        assert after["tokens"] == a["tokens"]  # the service is gone: recomputed, same tokens
        assert after["metrics"]["vllm:external_prefix_cache_hits"] == 0
    finally:
        if engine_b is not None and engine_b.proc.poll() is None:
            engine_b.kill()
        service.stop()
