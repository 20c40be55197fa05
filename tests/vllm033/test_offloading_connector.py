"""vLLM 0.33's own OffloadingConnector (TieringOffloadingSpec) with ChunkStoreTier from one JSON
entry, under vLLM's real Scheduler: chunks ChunkStoreConnector saved are looked up through the
tier and promoted, byte-exact, into vLLM's CPU primary tier; the request then waits for the
worker's CPU -> GPU copy (no GPU worker here: that part is not run on this machine)."""

from __future__ import annotations

import time

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from chunkstore.vllm.native.tier import ChunkStoreTier
from chunkstore.vllm.testing import sample_prompt_ids
from tests.vllm.harness import BLOCK, DIM, HEADS, LAYERS

from .tier_harness import CHUNK_TOKENS, make_request, nhd_slot

PROMPT = sample_prompt_ids(300, seed=33)


def native_scheduler(model_dir, kv_dir) -> Scheduler:
    """vLLM's Scheduler with OffloadingConnector + TieringOffloadingSpec + the chunkstore tier."""
    model = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0, max_model_len=2048)
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 4 << 20,
            "block_size": CHUNK_TOKENS,
            "secondary_tiers": [
                {
                    "type": "ChunkStoreTier",
                    "module_path": "chunkstore.vllm.native",
                    "tiers": [str(kv_dir)],
                }
            ],
        },
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=128, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), full)]
    )
    config.cache_config.num_gpu_blocks = 128
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


def test_native_offloading_promotes_connector_chunks_into_its_primary_tier(
    harness, tiny_model, tmp_path
):
    kv_dir = tmp_path / "kv"
    h = harness(extra={"tiers": [str(kv_dir)]})
    h.add(PROMPT)
    h.run()
    h.connector.store.flush()

    scheduler = native_scheduler(tiny_model, kv_dir)
    try:
        (tier,) = scheduler.connector.connector_scheduler.manager.secondary_tiers
        assert isinstance(tier, ChunkStoreTier)
        assert tier.primary.kv_bytes == tier.block_size_bytes  # vLLM's slot size, ours agrees
        request = make_request(PROMPT, "native")
        scheduler.add_request(request)
        for _ in range(500):  # lookups answer RETRY until the tier's check returns
            scheduler.schedule()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
            time.sleep(0.005)
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert request.num_computed_tokens == 256  # four 64-token chunks hit
        slots = torch.frombuffer(tier._flat, dtype=torch.uint8).view(-1, tier.block_size_bytes)
        for i in range(4):
            expected = nhd_slot(PROMPT, i * CHUNK_TOKENS)
            assert any(torch.equal(slot, expected) for slot in slots), f"chunk {i} not promoted"
    finally:
        scheduler.shutdown()
