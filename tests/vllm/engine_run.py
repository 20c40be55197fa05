"""Run the tiny vLLM engine on CPU with ChunkStoreConnector; the tests run it in a subprocess.

``python -m tests.vllm.engine_run MODEL_DIR STORE_DIR PROMPTS_JSON OUT_JSON [--twice] [--shutdown]``

For each prompt (a list of token ids) it generates 12 greedy tokens and
records them with the external prefix-cache hits (``vllm:external_prefix_cache_hits``)
and the connector's counters that this prompt added. ``--twice`` runs the
prompts again after ``reset_prefix_cache()`` (run 2 reloads what run 1 saved)
and writes ``{"run1": [...], "run2": [...]}``; otherwise the list of one run.
``--shutdown`` (with ``--twice``) then shuts the engine down as ``LLM`` does at exit and
records under ``"lifecycle"`` which chunkstore stores were open before and after, and
which of the engine's names are left in ``/dev/shm``.

Every engine runs in its own process: vLLM's start-up walks the attributes of
every imported module, which breaks on whatever else a test process imported
(werkzeug's proxies, from moto), and leaves global state behind.
"""

from __future__ import annotations

import json
import os
import sys

from chunkstore.vllm.testing import engine_env

os.environ.update(engine_env())

MAX_TOKENS = 12


def make_llm(model_dir: str, store_dir: str | None, **extra):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if store_dir is not None:
        transfer = KVTransferConfig(
            kv_connector="ChunkStoreConnector",
            kv_connector_module_path="chunkstore.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "host_cache": "64M",
                "chunk_tokens": 64,
                "tiers": [f"file://{store_dir}"],
                **extra,
            },
            kv_load_failure_policy="recompute",
        )
    return LLM(
        model=model_dir,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        block_size=32,
        dtype="bfloat16",
        max_model_len=2048,
        seed=0,
        kv_transfer_config=transfer,
        disable_log_stats=False,
    )


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(("vllm:external_prefix_cache", "vllm:chunkstore_")):
            out[metric.name] = float(getattr(metric, "value", 0) or 0)
        elif metric.name == "vllm:prompt_tokens_cached_by_source":
            source = metric.labels.get("source", "?")
            out[f"cached_by_source:{source}"] = float(getattr(metric, "value", 0) or 0)
    return out


def generate(llm, prompts: list[list[int]]) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = []
    for prompt in prompts:
        before = counters(llm)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        after = counters(llm)
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
        results.append({"tokens": list(out[0].outputs[0].token_ids), "metrics": delta})
    return results


def flush(llm) -> None:
    """Wait for write-behind to the directory store (the engine shares its store per process)."""
    from chunkstore.vllm.shared import flush_shared

    flush_shared(timeout=30)


def library_metrics() -> dict[str, float]:
    """Every ``chunkstore_*`` sample of this process's default registry, as ``name{labels}``."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("chunkstore_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return out


def lifecycle(llm) -> dict[str, object]:
    """Shut the engine down; what of chunkstore's stays behind."""
    from pathlib import Path

    from chunkstore.vllm.shared import shared_names

    pool = f"vllm-{llm.llm_engine.vllm_config.kv_transfer_config.engine_id}"
    before = shared_names()
    llm.llm_engine.engine_core.shutdown()
    shm = Path("/dev/shm")
    left = sorted(p.name for p in shm.glob(f"{pool}*")) if shm.is_dir() else []
    return {"pool": pool, "open_before": before, "open_after": shared_names(), "shm_left": left}


def main(argv: list[str]) -> int:
    model_dir, store_dir, prompts_path, out_path = argv[:4]
    prompts = json.loads(open(prompts_path).read())
    llm = make_llm(model_dir, store_dir)
    results: object = generate(llm, prompts)
    flush(llm)
    if "--twice" in argv:
        assert llm.reset_prefix_cache()
        results = {"run1": results, "run2": generate(llm, prompts)}
        flush(llm)
        results["library_metrics"] = library_metrics()
        if "--shutdown" in argv:
            results["lifecycle"] = lifecycle(llm)
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
