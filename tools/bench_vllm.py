#!/usr/bin/env python3
"""Second-turn time to first token on the tiny CPU vLLM engine: reload vs recompute.

    python tools/bench_vllm.py [--layers 8] [--prompt-tokens 2048] [--prompts 3] [--json]

A random 8-layer Llama (no downloads) serves ``--prompts`` prompts of
``--prompt-tokens`` tokens twice. The second turn's time to first token
(a 1-token generation, i.e. the prefill) is measured three ways:

* recompute: an engine without the connector, after ``reset_prefix_cache()``;
* host: ChunkStoreConnector, chunks reloaded from host memory;
* directory: the same engine after its host memory is dropped
  (``reset_prefix_cache(reset_connector=True)``), chunks read from a directory store.

Each mode runs in its own process (one engine per process). Prints the medians
and the ratios recompute / reload.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _ttft(llm, prompts) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for prompt in prompts:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return times


def run_mode(mode: str, model: str, store: str, n_prompts: int, n_tokens: int) -> dict:
    os.environ.update(engine_env())
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if mode != "recompute":
        transfer = KVTransferConfig(
            kv_connector="ChunkStoreConnector",
            kv_connector_module_path="chunkstore.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "host_cache": "1G",
                "chunk_tokens": 256,
                "tiers": [f"file://{store}"],
            },
        )
    llm = LLM(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        block_size=128,
        dtype="bfloat16",
        max_model_len=n_tokens + 64,
        seed=0,
        kv_transfer_config=transfer,
    )
    prompts = [sample_prompt_ids(n_tokens, seed=100 + i) for i in range(n_prompts)]
    first = _ttft(llm, prompts)  # turn 1: compute (and save)
    out = {"first_turn": first}
    if mode == "recompute":
        llm.reset_prefix_cache()
        out["recompute"] = _ttft(llm, prompts)
    else:
        from chunkstore.vllm.shared import flush_shared

        flush_shared(timeout=60)
        llm.reset_prefix_cache()
        out["host"] = _ttft(llm, prompts)
        llm.reset_prefix_cache(reset_connector=True)
        out["directory"] = _ttft(llm, prompts)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.mode:  # child process
        result = run_mode(args.mode, args.model, args.store, args.prompts, args.prompt_tokens)
        print("RESULT " + json.dumps(result))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        spec = benchmark_model_spec(args.layers, args.prompt_tokens + 64)
        model = make_tiny_llama(Path(tmp) / "model", spec)
        store = Path(tmp) / "store"
        store.mkdir()
        results: dict[str, list[float]] = {}
        for mode in ("recompute", "connector"):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--mode",
                    mode,
                    "--model",
                    str(model),
                    "--store",
                    str(store),
                    "--prompts",
                    str(args.prompts),
                    "--prompt-tokens",
                    str(args.prompt_tokens),
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.stderr.write(proc.stderr[-4000:])
                return 1
            for key, values in json.loads(line[7:]).items():
                if key != "first_turn":
                    results[key] = values
        chunk_bytes = sum(p.stat().st_size for p in store.rglob("*.kvc"))

    # The minimum is the least disturbed by other work on a shared machine; medians shown too.
    med = {k: min(v) for k, v in results.items()}
    mid = {k: statistics.median(v) for k, v in results.items()}
    summary = {
        "model": f"{args.layers} layers, 8 heads, 4 KV heads, head_dim 64, bf16, CPU",
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "ttft_min_s": {k: round(v, 4) for k, v in med.items()},
        "ttft_median_s": {k: round(v, 4) for k, v in mid.items()},
        "speedup_host": round(med["recompute"] / med["host"], 2),
        "speedup_directory": round(med["recompute"] / med["directory"], 2),
        "store_bytes": chunk_bytes,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"second-turn TTFT, {args.prompts} prompts x {args.prompt_tokens} tokens, "
            f"{summary['model']}"
        )
        for k in ("recompute", "host", "directory"):
            print(f"  {k:<10} min {med[k] * 1000:8.1f} ms   median {mid[k] * 1000:8.1f} ms")
        print(f"  reload from host:      {summary['speedup_host']:.2f}x faster than recompute")
        print(f"  reload from directory: {summary['speedup_directory']:.2f}x faster than recompute")
        print(f"  directory store: {chunk_bytes / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
