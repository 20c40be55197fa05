#!/usr/bin/env python3
"""Two engines sharing a system prompt: one node service vs one host cache per engine.

    python tools/bench_node_engines.py [--layers 8] [--system-tokens 2048] [--json]

A random Llama (CPU, no downloads) answers one request per engine: engine A, then
engine B, each in its own process, both prompts starting with the same
``--system-tokens`` system prompt. Two setups:

* ``per-engine``: each engine has its own host cache (``host_cache``): B cannot
  see what A computed and recomputes the system prompt; host memory holds it twice;
* ``node``: both attach to one ``chunkstore serve --node`` (connector option
  ``node``): B's first request loads the system prompt A saved.

Reported: engine B's time to first token (a 1-token generation) and the host
memory holding chunks after both ran. Numbers only; nothing fails on a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chunkstore.vllm.testing import (  # noqa: E402
    benchmark_model_spec,
    engine_env,
    make_tiny_llama,
    sample_prompt_ids,
)

TAIL = 128
"""Tokens of each engine's own question after the shared system prompt."""


def run_engine(model: str, node: str | None, prompt: list[int], max_len: int) -> dict:
    """One engine, one request: its time to first token and its own host memory in use."""
    os.environ.update(engine_env())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra: dict[str, object] = {"chunk_tokens": 256}
    extra.update({"node": f"unix://{node}"} if node else {"host_cache": "1G"})
    llm = LLM(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        block_size=128,
        dtype="bfloat16",
        max_model_len=max_len,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="ChunkStoreConnector",
            kv_connector_module_path="chunkstore.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    started = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=1),
        use_tqdm=False,
    )
    ttft = time.perf_counter() - started
    from prometheus_client import REGISTRY

    own = sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == "chunkstore_host_cache_bytes_used"
    )
    return {"ttft_s": ttft, "host_bytes": own}


def _engine(model: Path, node: Path | None, prompt: list[int], max_len: int) -> dict:
    args = [sys.executable, __file__, "--engine", str(model), "--prompt", json.dumps(prompt)]
    args += ["--max-len", str(max_len)] + (["--node", str(node)] if node else [])
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(line[7:])


def _chunk_size(model: Path, layers: int) -> int:
    from chunkstore.format import ATTENTION, ChunkLayout, KVSpec, LayerGroup

    group = LayerGroup(ATTENTION, tuple(range(layers)), num_kv_heads=4, head_dim=64)
    return ChunkLayout(KVSpec(str(model), "BF16", 256, (group,))).total_size


def _node_used(socket: Path, slot_size: int) -> int:
    from chunkstore.node import NodeClient

    client = NodeClient(str(socket), slot_size=slot_size)
    try:
        return int(client.stats().get("used_bytes") or 0)
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    parser.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--node", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:  # child process
        result = run_engine(args.engine, args.node, json.loads(args.prompt), args.max_len)
        print("RESULT " + json.dumps(result))
        return 0
    try:
        import vllm  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        print(f"skipped: needs {exc.name} (pip install 'chunkstore[vllm,peer]')")
        return 0

    system = sample_prompt_ids(args.system_tokens, seed=5)
    prompt_a = system + sample_prompt_ids(TAIL, seed=6)
    prompt_b = system + sample_prompt_ids(TAIL, seed=7)
    max_len = args.system_tokens + TAIL + 64
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-node-") as tmp:
        spec = benchmark_model_spec(args.layers, max_len)
        model = make_tiny_llama(Path(tmp) / "model", spec)
        a = _engine(model, None, prompt_a, max_len)
        b = _engine(model, None, prompt_b, max_len)
        out["per-engine"] = {
            "ttft_b_s": b["ttft_s"],
            "host_bytes": a["host_bytes"] + b["host_bytes"],
        }

        socket = Path(tmp) / "node.sock"
        slot = _chunk_size(model, args.layers)
        service = subprocess.Popen(
            [sys.executable, "-m", "chunkstore.cli.main", "serve", "--slot-size", str(slot)]
            + ["--host-cache", "1G", "--node", str(socket)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert service.stdout is not None
            while not service.stdout.readline().startswith("serving:"):
                if service.poll() is not None:
                    print("the node service did not start", file=sys.stderr)
                    return 1
            _engine(model, socket, prompt_a, max_len)
            b = _engine(model, socket, prompt_b, max_len)
            out["node"] = {"ttft_b_s": b["ttft_s"], "host_bytes": _node_used(socket, slot)}
        finally:
            service.terminate()
            service.wait(timeout=60)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"{args.layers}-layer tiny Llama on CPU, {args.system_tokens}-token system prompt, "
        f"{TAIL}-token questions"
    )
    for setup, row in out.items():
        print(
            f"{setup:10s}: engine B time to first token {row['ttft_b_s'] * 1000:8.1f} ms, "
            f"host memory holding chunks {row['host_bytes'] / 2**20:8.1f} MiB"
        )
    ratio = out["per-engine"]["ttft_b_s"] / out["node"]["ttft_b_s"]
    print(f"node: engine B's first token {ratio:.2f}x sooner, host memory for one copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
