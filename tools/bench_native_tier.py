"""vLLM 0.33's built-in fs tier vs ChunkStoreTier: the same blocks, under the same directory.

Both tiers are built the way vLLM builds them (a memoryview CPU primary, the factory, one
config entry each) over one primary region filled with random KV, then:

* store: every chunk demoted to the tier, jobs of ``--batch`` chunks, all in flight;
* load: every chunk promoted back into other primary slots, checked byte for byte;
* ``--rounds`` times, each tier in turn (order rotated), new chunks every round, the tiers
  built once (as in a running engine, garbage collector frozen as vLLM's engine freezes it);
* a flipped byte on disk: one bit of one stored chunk flipped, that chunk loaded again, and
  what each tier did reported (loaded silently, failed the load, slot untouched or not).

Throughputs are reported as chunkstore / vLLM ratios per round (>= 1.0 means chunkstore is as
fast; median and range over the rounds), with chunkstore verifying a checksum on every load.
Needs the vllm 0.33 environment (``make test-vllm033`` builds it); run from the main one, it
re-runs itself there or says how to get it. Numbers, never a pass/fail threshold.

    .venv-vllm033/bin/python tools/bench_native_tier.py [--chunks 64] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm033"
VENV_PYTHON = VENV / "bin" / "python"


def _has_tiering() -> bool:
    try:
        import vllm
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager  # noqa: F401
    except ImportError:
        return False
    return vllm.__version__.startswith("0.33.")


def _reexec() -> int:
    if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV.resolve():
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        return subprocess.call([str(VENV_PYTHON), __file__, *sys.argv[1:]], env=env)
    print(
        "skipped: needs vLLM 0.33's offloading tiers; build its environment with "
        "`make test-vllm033` (creates .venv-vllm033), then run `make bench` again"
    )
    return 0


LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS_PER_CHUNK = 8, 8, 128, 16, 4
"""A Llama-like attention geometry: 8 layers x 8 KV heads x 128, 64-token chunks (2 MiB)."""


def _engine(model_dir: Path) -> tuple[Any, Any]:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0, max_model_len=4096)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK),
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_cache_config = KVCacheConfig(
        num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    return config, kv_cache_config


def _offloading_spec(slot_bytes: int) -> Any:
    from types import SimpleNamespace

    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=names, group_id=0),),
        worker_kv_bytes_per_block=slot_bytes // BLOCKS_PER_CHUNK,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout="LBNHC",
    )
    return SimpleNamespace(
        config=config,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        kv_events_config=OffloadingKVEventsConfig(False, False),
    )


def _build(
    entry: dict[str, Any], mem: Any, spec: Any, vllm_config: Any, kv_cache_config: Any
) -> Any:
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    # ChunkStoreTier reads these two from its caller's frame, as under vLLM's connector.
    assert vllm_config is not None and kv_cache_config is not None
    return SecondaryTierFactory.create_secondary_tier(entry, memoryview(mem.numpy()), spec)


def _jobs(
    keys: list[Any], ctx: Any, batch: int, first_slot: int, promotion: bool, first_id: int
) -> list[Any]:
    """Jobs of ``batch`` consecutive chunks, chunk i in primary slot ``first_slot + i``."""
    import numpy as np
    from vllm.v1.kv_offload.tiering.base import TransferJob

    return [
        TransferJob(
            job_id=first_id + j,
            keys=keys[j : j + batch],
            chunk_ids=np.arange(first_slot + j, first_slot + min(j + batch, len(keys))),
            is_promotion=promotion,
            req_context=ctx,
        )
        for j in range(0, len(keys), batch)
    ]


def _run(tier: Any, jobs: list[Any]) -> tuple[float, list[Any]]:
    t0 = time.perf_counter()
    for job in jobs:
        if job.is_promotion:
            tier.submit_load(job)
        else:
            tier.submit_store(job)
    tier.drain_jobs()
    results = list(tier.get_finished_jobs())
    return time.perf_counter() - t0, results


def _quiet() -> None:
    """Start a timed phase from the same state for every tier: dirty pages (the buffered
    tier's, other processes') written out first, so no tier's phase pays for another's."""
    os.sync()


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=64, help="chunks stored and loaded")
    parser.add_argument("--batch", type=int, default=8, help="chunks per job")
    parser.add_argument("--threads", type=int, default=8, help="I/O threads of each tier")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds, each tier in turn, new chunks each round"
    )
    parser.add_argument(
        "--dir", default=None, help="directory both tiers write under (vllm-fs/, chunkstore/)"
    )
    args = parser.parse_args()
    if not _has_tiering():
        return _reexec()

    import gc

    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.request import Request

    from chunkstore.vllm.testing import TinyModelSpec, make_tiny_llama, sample_prompt_ids

    n, chunk_tokens = args.chunks, BLOCK * BLOCKS_PER_CHUNK
    slot_bytes = LAYERS * BLOCKS_PER_CHUNK * HEADS * BLOCK * 2 * HEAD_DIM * 2
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-native-tier-"))
    model_dir = make_tiny_llama(
        work / "model",
        TinyModelSpec(num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS, head_dim=HEAD_DIM),
    )
    vllm_config, kv_cache_config = _engine(model_dir)
    spec = _offloading_spec(slot_bytes)
    init_none_hash(sha256)
    # Page-aligned like vLLM's shared mmap region (O_DIRECT needs aligned buffers).
    region = mmap.mmap(-1, (2 * n + 1) * slot_bytes)
    mem = torch.frombuffer(region, dtype=torch.uint8).view(2 * n + 1, slot_bytes)
    gen = torch.Generator().manual_seed(0)
    # Random bf16 values (finite): what the KV of a real model looks like to a disk.
    mem[:n] = torch.randn(n, slot_bytes // 2, generator=gen).to(torch.bfloat16).view(torch.uint8)
    print(
        f"{n} chunks of {slot_bytes / 2**20:.1f} MiB ({chunk_tokens} tokens, {LAYERS} layers x "
        f"{HEADS} heads x {HEAD_DIM}, bf16), jobs of {args.batch}, {args.threads} threads, "
        f"{args.rounds} rounds, directory {work}"
    )

    entries = {
        "vllm fs": {
            "type": "fs",
            "root_dir": str(work / "vllm-fs"),
            "n_read_threads": args.threads,
            "n_write_threads": args.threads,
        },
        "vllm fs, buffered": {
            "type": "fs",
            "root_dir": str(work / "vllm-fs-buffered"),
            "n_read_threads": args.threads,
            "n_write_threads": args.threads,
        },
        "chunkstore": {
            "type": "ChunkStoreTier",
            "module_path": "chunkstore.vllm.native",
            "tiers": [str(work / "chunkstore")],
            "threads": args.threads,
        },
    }
    import vllm.v1.kv_offload.tiering.fs.manager as fs_manager

    tiers: dict[str, Any] = {}
    probe_o_direct = fs_manager.probe_o_direct
    try:
        for name, entry in entries.items():
            # "buffered": vLLM's tier as it runs where O_DIRECT is refused (its own fallback):
            # through the page cache.
            fs_manager.probe_o_direct = (
                (lambda _dir: False) if "buffered" in name else probe_o_direct
            )
            tiers[name] = _build(entry, mem, spec, vllm_config, kv_cache_config)
        fs_manager.probe_o_direct = probe_o_direct
        # As vLLM's engine core does once it is set up (freeze_gc_heap): what exists now is
        # never scanned again, so a full collection of torch's and vLLM's objects does not
        # land in one tier's timed phase (it measured 0.3 s, a 0.2x round, before).
        gc.collect()
        gc.freeze()
        figures: dict[str, dict[str, list[float]]] = {m: {"store": [], "load": []} for m in tiers}
        ok = dict.fromkeys(tiers, True)
        flipped: dict[str, str] = {}
        order = list(tiers)
        for r in range(args.rounds):
            prompt = sample_prompt_ids(n * chunk_tokens + 1, seed=7 + r)
            request = Request(
                f"bench-{r}",
                prompt,
                SamplingParams(max_tokens=1),
                None,
                block_hasher=get_request_block_hasher(BLOCK, sha256),
            )
            # Each tier in turn, the order rotated every round: none always follows another.
            for name in order[r % len(order) :] + order[: r % len(order)]:
                tier = tiers[name]
                ctx = ReqContext(req_id=request.request_id)
                tier.on_new_request(ctx)
                keys = []
                for i in range(n):
                    key = make_offload_key(request.block_hashes[(i + 1) * BLOCKS_PER_CHUNK - 1], 0)
                    ctx.set_offload_key_position(key, (i + 1) * chunk_tokens)
                    keys.append(key)
                _quiet()
                store_s, stored = _run(tier, _jobs(keys, ctx, args.batch, 0, False, 0))
                mem[n : 2 * n] = 0
                _quiet()
                load_s, loaded = _run(tier, _jobs(keys, ctx, args.batch, n, True, 10_000))
                exact = torch.equal(mem[n : 2 * n], mem[:n])
                figures[name]["store"].append(n * slot_bytes / store_s / 1e9)
                figures[name]["load"].append(n * slot_bytes / load_s / 1e9)
                ok[name] = ok[name] and all(j.success for j in stored + loaded) and exact
                if r == args.rounds - 1:
                    flipped[name] = _flip_one_bit(name, tier, keys, ctx, work, mem, n)
        for name in tiers:
            store, load = figures[name]["store"], figures[name]["load"]
            print(
                f"{name:>17}: store {statistics.median(store):.2f} GB/s, load "
                f"{statistics.median(load):.2f} GB/s (medians of {args.rounds}), all jobs ok "
                f"and bytes exact: {ok[name]}"
            )
            print(f"{name:>17}: one flipped bit on disk -> {flipped[name]}")
        cs = figures["chunkstore"]
        for name in ("vllm fs", "vllm fs, buffered"):
            fs = figures[name]
            store_ratio = [c / v for c, v in zip(cs["store"], fs["store"])]
            load_ratio = [c / v for c, v in zip(cs["load"], fs["load"])]
            print(
                f"chunkstore / {name}: store {_spread(store_ratio)}, load {_spread(load_ratio)} "
                f"per round (O_DIRECT: {getattr(tiers[name], '_use_o_direct', '?')}; every "
                "chunkstore load is verified)"
            )
    finally:
        fs_manager.probe_o_direct = probe_o_direct
        for tier in tiers.values():
            tier.shutdown()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def _flip_one_bit(
    name: str, tier: Any, keys: list[Any], ctx: Any, work: Path, mem: Any, n: int
) -> str:
    """Flip one bit of the first chunk's file, load it again into the spare slot and say
    what the tier did (loaded silently, failed the load, slot untouched or not)."""
    import numpy as np
    import torch
    from vllm.v1.kv_offload.tiering.base import TransferJob

    path = _file_of(name, tier, keys[0], ctx, work)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    spare = 2 * n
    mem[spare] = 0xA5
    _, (result,) = _run(tier, [TransferJob(99_999, [keys[0]], np.array([spare]), True, ctx)])
    if result.success and torch.equal(mem[spare], mem[0]):
        verdict = "loaded the chunk unchanged (the flip was outside the KV bytes)"
    elif result.success:
        verdict = "loaded it as good: the slot now holds corrupt KV"
    else:
        untouched = bool((mem[spare] == 0xA5).all())
        verdict = "failed the load" + (
            ", primary slot untouched" if untouched else ", slot partly written"
        )
    return verdict


def _file_of(name: str, tier: Any, key: Any, ctx: Any, work: Path) -> Path:
    if name.startswith("vllm fs"):
        return Path(tier.file_mapper.get_file_name(key))
    return Path(tier.stores[0].path_of(tier._address(key, ctx).key))


if __name__ == "__main__":
    sys.exit(main())
