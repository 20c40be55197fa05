"""Build a ChunkStoreTier the way vLLM's own tiering tests build theirs: a plain memoryview as
the CPU primary tier, an ``OffloadingConfig`` describing the engine, jobs submitted by hand.

The engine description the tier reads from its caller (``vllm_config``, ``kv_cache_config``)
comes from the connector test harness, so the tier and ChunkStoreConnector describe the same
engine (tiny Llama, 2 layers, 2 KV heads of 32, block 32, 64-token chunks).
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tests.vllm.harness import BLOCK, DIM, HEADS, LAYERS, expected_kv

BLOCKS_PER_CHUNK = 2
CHUNK_TOKENS = BLOCKS_PER_CHUNK * BLOCK
SLOT_BYTES = len(LAYERS) * BLOCKS_PER_CHUNK * HEADS * BLOCK * 2 * DIM * 2  # bf16
NUM_SLOTS = 16
_jobs = itertools.count(1)


def offloading_spec(tp_size: int = 1, layout: str = "LBNHC", events: bool = False) -> Any:
    """What TieringOffloadingSpec hands a tier: its normalized config and chunk size."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=LAYERS, group_id=0),),
        worker_kv_bytes_per_block=SLOT_BYTES // BLOCKS_PER_CHUNK // tp_size,
        enable_kv_cache_events=events,
        extra_config={},
        engine_id="test-engine",
        model=OffloadingModelConfig(name="tiny", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
        kv_cache_layout=layout,
    )
    return SimpleNamespace(
        config=config,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        kv_events_config=OffloadingKVEventsConfig(events, False),
    )


def primary(num_slots: int = NUM_SLOTS) -> torch.Tensor:
    """The CPU primary tier's memory: ``num_slots`` slots of ``SLOT_BYTES``."""
    return torch.zeros(num_slots, SLOT_BYTES, dtype=torch.uint8)


def make_tier(
    harness: Any,
    primary_kv: torch.Tensor,
    tiers: list[str],
    *,
    events: bool = False,
    **options: Any,
) -> Any:
    """The tier as vLLM's factory builds it from one JSON entry (``events``: vLLM's KV events
    are on)."""
    # The tier reads the engine's description from its caller, as it does under
    # OffloadingConnectorScheduler.__init__ (these two locals).
    vllm_config = harness.scheduler.vllm_config
    kv_cache_config = harness.scheduler.kv_cache_config
    assert vllm_config is not None and kv_cache_config is not None
    entry = {
        "type": "ChunkStoreTier",
        "module_path": "chunkstore.vllm.native",
        "tiers": tiers,
        **options,
    }
    return SecondaryTierFactory.create_secondary_tier(
        entry, memoryview(primary_kv.numpy()), offloading_spec(events=events)
    )


def announce(tier: Any, request: Any) -> ReqContext:
    """Start a request as OffloadingConnectorScheduler.on_new_request(request) does."""
    ctx = ReqContext(req_id=request.request_id)
    tier.on_new_request(ctx)
    return ctx


def offload_keys(request: Any, ctx: ReqContext, chunks: int) -> list[bytes]:
    """vLLM's offload keys of the request's first ``chunks`` chunks, positions recorded."""
    keys = []
    per_chunk = CHUNK_TOKENS // BLOCK
    for i in range(chunks):
        key = make_offload_key(request.block_hashes[(i + 1) * per_chunk - 1], 0)
        ctx.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
        keys.append(key)
    return keys


def job(keys: list[bytes], slots: list[int], ctx: ReqContext, *, promotion: bool) -> TransferJob:
    return TransferJob(
        job_id=next(_jobs),
        keys=keys,
        chunk_ids=np.array(slots, dtype=np.int32),
        is_promotion=promotion,
        req_context=ctx,
    )


def finish(tier: Any) -> list[Any]:
    """Wait for every job, then collect the results (as vLLM's tests do)."""
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookup(tier: Any, keys: list[bytes], ctx: ReqContext, deadline_s: float = 30.0) -> list[Any]:
    """Look keys up until none answers RETRY (the scheduler re-asks every step)."""
    end = time.monotonic() + deadline_s
    while True:
        results = [tier.lookup(k, ctx) for k in keys]
        if LookupResult.RETRY not in results or time.monotonic() > end:
            return results
        time.sleep(0.005)


def nhd_slot(tokens: list[int], start: int) -> torch.Tensor:
    """A primary slot as a GPU worker writes it (LBNHC pages: per token, per head, K then V)
    holding the stand-in model's KV for ``tokens[start:start+CHUNK_TOKENS]``; built here
    without the tier's conversion code."""
    positions = torch.arange(start, start + CHUNK_TOKENS)
    toks = torch.tensor(tokens[start : start + CHUNK_TOKENS])
    parts = []
    for name in LAYERS:
        layer = int(name.split(".")[2])
        k, v = expected_kv(layer, positions, toks)  # [H, T, D]
        page = torch.cat((k, v), dim=-1).permute(1, 0, 2)  # [T, H, 2D]: blocks of N tokens
        parts.append(page.contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


def make_request(prompt: list[int], req_id: str) -> Any:
    """A vLLM Request with the harness's block hasher (same block hashes as the scheduler's)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1, temperature=0.0)
    return Request(
        req_id, list(prompt), params, None, block_hasher=get_request_block_hasher(BLOCK, sha256)
    )
