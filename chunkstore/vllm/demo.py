"""``chunkstore demo --vllm``: a tiny vLLM engine on CPU, its prompts computed once and reloaded.

The demo builds a random-weight Llama at run time and downloads nothing. vLLM
serves it with :class:`~chunkstore.vllm.ChunkStoreConnector`. The connector
uses a directory store. The engine gets the same long prompts three times.

1. Cold: computed, and saved as chunks.
2. After ``reset_prefix_cache()``: reloaded from host memory.
3. After the connector's host memory is dropped too: reloaded from the directory.

Each turn prints its time to first token. It also prints where the prompt's
tokens came from, as vLLM's ``prompt_tokens_cached_by_source``. Needs the
``vllm`` extra.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkstore.vllm.testing import TinyModelSpec, engine_env, make_tiny_llama, sample_prompt_ids

__all__ = ["DEMO_MODEL", "DemoTurn", "VllmDemoResult", "run_vllm_demo"]

# Large enough that prefill costs something on a CPU, small enough to build in seconds.
DEMO_MODEL = TinyModelSpec(
    num_layers=4,
    num_heads=8,
    num_kv_heads=4,
    head_dim=64,
    intermediate_size=1024,
    max_position_embeddings=4096,
)
"""The demo model's shape."""


@dataclass(frozen=True, slots=True)
class DemoTurn:
    """One pass over the demo prompts."""

    label: str
    """What the turn shows."""
    ttft_s: float
    """Median time to first token over the prompts, in seconds."""
    cached_tokens: dict[str, int]
    """Prompt tokens served from a cache, by vLLM's source label."""
    prompt_tokens: int
    """Prompt tokens over all prompts."""
    # Equal in every turn if reloads are right.
    first_tokens: tuple[int, ...]
    """The greedy first token of every prompt."""

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine computed in this turn."""
        return self.prompt_tokens - sum(self.cached_tokens.values())


@dataclass(frozen=True, slots=True)
class VllmDemoResult:
    """What :func:`run_vllm_demo` measured."""

    store: str
    """URL of the directory store the chunks went to."""
    turns: tuple[DemoTurn, ...]
    """The three turns: cold, host reload, directory reload."""
    chunk_files: int
    """Chunk files in the store afterwards."""

    @property
    def same_tokens(self) -> bool:
        """Whether every turn produced the same first tokens."""
        return len({t.first_tokens for t in self.turns}) == 1


def _cached_by_source(llm: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_cached_by_source":
            source = metric.labels.get("source", "?")
            out[source] = out.get(source, 0) + int(getattr(metric, "value", 0) or 0)
    return out


def _turn(llm: Any, label: str, prompts: list[list[int]]) -> DemoTurn:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    before = _cached_by_source(llm)
    times, firsts = [], []
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        firsts.append(int(out[0].outputs[0].token_ids[0]))
    after = _cached_by_source(llm)
    cached = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    times.sort()
    return DemoTurn(
        label, times[len(times) // 2], cached, sum(len(p) for p in prompts), tuple(firsts)
    )


def _store_url(store: str | None, scratch: Path) -> str:
    if store is None:
        path = scratch / "kv"
        path.mkdir()
        return f"file://{path}"
    if "://" in store:
        return store
    return f"file://{Path(store).resolve()}"


def run_vllm_demo(
    store: str | None = None,
    *,
    prompts: int = 3,
    prompt_tokens: int = 1536,
    out: Callable[[str], None] = print,
) -> VllmDemoResult:
    """Run the three turns and print a table.

    ``store`` defaults to a temporary directory.
    """
    for name, value in engine_env().items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table is the output
    with tempfile.TemporaryDirectory(prefix="chunkstore-vllm-demo-") as tmp:
        scratch = Path(tmp)
        url = _store_url(store, scratch)
        spec = DEMO_MODEL
        out(
            f"chunkstore demo --vllm: random Llama ({spec.num_layers} layers, "
            f"{spec.num_kv_heads} KV heads x {spec.head_dim}, bf16) on CPU, built locally"
        )
        out(f"  store {url}, {prompts} prompts x {prompt_tokens} tokens, chunks of 256 tokens")
        model = make_tiny_llama(scratch / "model", spec)
        llm = _engine(str(model), url, prompt_tokens)
        asks = [
            sample_prompt_ids(prompt_tokens, spec.vocab_size, seed=500 + i) for i in range(prompts)
        ]
        # Warm the engine up on an unrelated prompt: the first request pays one-off costs.
        _turn(llm, "warm-up", [sample_prompt_ids(64, spec.vocab_size, seed=499)])
        turns = [_turn(llm, "cold: computed, saved", asks)]
        _flush()
        llm.reset_prefix_cache()
        turns.append(_turn(llm, "reload from host memory", asks))
        llm.reset_prefix_cache(reset_connector=True)  # drops the connector's host memory too
        turns.append(_turn(llm, "reload from the directory", asks))
        _flush()
        files = _count_chunks(url)
        result = VllmDemoResult(url, tuple(turns), files)
        _print(result, out)
        _shutdown(llm)
        return result


def _engine(model: str, url: str, prompt_tokens: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    options: dict[str, Any] = {"host_cache": "1G", "chunk_tokens": 256, "tiers": [url]}
    transfer = KVTransferConfig(
        kv_connector="ChunkStoreConnector",
        kv_connector_module_path="chunkstore.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=options,
        kv_load_failure_policy="recompute",
    )
    return LLM(
        model=model,
        enforce_eager=True,
        kv_cache_memory_bytes=512 << 20,
        block_size=128,
        dtype="bfloat16",
        max_model_len=prompt_tokens + 64,
        seed=0,
        kv_transfer_config=transfer,
        disable_log_stats=False,
    )


def _flush() -> None:
    from chunkstore.vllm.shared import flush_shared

    flush_shared(timeout=60)


def _count_chunks(url: str) -> int:
    if not url.startswith("file://"):
        return 0
    root = Path(url[len("file://") :])
    return sum(1 for p in root.rglob("*.kvc") if "quarantine" not in p.parts)


def _shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()


def _print(result: VllmDemoResult, out: Callable[[str], None]) -> None:
    cold = result.turns[0]
    sources = sorted({s for t in result.turns for s in t.cached_tokens})
    header = f"  {'turn':<28} {'TTFT':>9}  " + "".join(f"{s:>8}" for s in sources)
    out("")
    out(header + f"{'computed':>10}  (prompt tokens by where they came from)")
    for i, turn in enumerate(result.turns, 1):
        cells = "".join(f"{turn.cached_tokens.get(s, 0):>8}" for s in sources)
        out(
            f"  {i}. {turn.label:<25} {turn.ttft_s * 1000:>6.1f} ms  {cells}"
            f"{turn.computed_tokens:>10}"
        )
    out("")
    for turn in result.turns[1:]:
        ratio = cold.ttft_s / turn.ttft_s if turn.ttft_s else float("inf")
        out(f"  {turn.label}: time to first token {ratio:.1f}x shorter than computing")
    same = "yes" if result.same_tokens else "NO"
    out(
        f"  same greedy first token in every turn: {same}; "
        f"{result.chunk_files} chunk files in {result.store}"
    )
