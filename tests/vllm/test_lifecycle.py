"""The connector's store ends with the engine: closed by the last connector, nothing in /dev/shm.

vLLM calls ``shutdown()`` on the worker's connector and then on the
scheduler's. At TP = 1 both share one store by name; at TP > 1 the scheduler's
store owns the host pool ``/dev/shm/vllm-<engine id>`` that the rank processes
attach. (The real engine at TP = 1 is covered in ``test_engine.py``; rank
processes at TP = 2 in ``test_tp.py``.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

from chunkstore.cache._pool import SHM_DIR  # noqa: E402
from chunkstore.tiering import RankCache  # noqa: E402
from chunkstore.vllm.connector import ChunkStoreConnector  # noqa: E402
from chunkstore.vllm.shared import shared_names

from .harness import BLOCK, DIM, HEADS, LAYERS, make_harness, shut_down  # noqa: E402


def test_tp1_the_last_connector_to_shut_down_closes_the_shared_store(tiny_model):
    h = make_harness(tiny_model)
    name, store = h.connector.pool_name, h.connector.store
    assert h.worker.store is store
    assert name in shared_names()
    h.worker.shutdown()
    assert not store.closed  # the scheduler's connector still uses it
    h.connector.shutdown()
    assert store.closed
    assert name not in shared_names()
    h.connector.shutdown()  # a second call (vLLM's finalizers) changes nothing
    assert name not in shared_names()


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")
def test_tp2_scheduler_shutdown_removes_the_host_pool_from_dev_shm(tiny_model):
    h = make_harness(tiny_model)
    shut_down(h)
    config = h.scheduler.vllm_config
    config.parallel_config.tensor_parallel_size = 2
    # What vLLM gives each rank at TP = 2: half of the model's KV heads.
    per_rank = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS // 2, head_size=DIM, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=128,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), per_rank)],
    )
    connector = ChunkStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    pool = SHM_DIR / connector.pool_name
    rank = RankCache(connector.pool_name, connector.engine.layout, rank=1, tp=2)
    try:
        assert pool.exists()  # the shared pool the rank processes attach
        assert rank.assembler() is not None
        rank.close()  # a rank's connector shutdown detaches
        assert pool.exists()
        connector.shutdown()
        assert not pool.exists()
        assert connector.pool_name not in shared_names()
    finally:
        rank.close()
        connector.shutdown()
