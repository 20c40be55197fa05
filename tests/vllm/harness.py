"""Drive vLLM's real ``Scheduler`` with ChunkStoreConnector, without an engine.

The scheduler and its connector are vLLM's and ours, unchanged. The "model"
is a stand-in that writes, for every scheduled token, a KV value that is a
pure function of (layer, head, position, token) into the request's blocks,
through the same layout class the worker uses. So after a load the device
blocks can be compared exactly with what a forward pass would have written.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from chunkstore.vllm.connector import ChunkStoreConnector
from chunkstore.vllm.layouts import CpuVecLayout

BLOCK = 32
HEADS = 2
DIM = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
EOS = 2
_ids = itertools.count()


def expected_kv(
    layer: int, positions: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stand-in model's K and V, ``[heads, len(positions), DIM]``: exact in bf16."""
    h = torch.arange(HEADS).view(HEADS, 1, 1)
    d = torch.arange(DIM).view(1, 1, DIM)
    p = positions.view(1, -1, 1)
    t = tokens.view(1, -1, 1)
    k = ((t * 7 + p * 3 + h * 5 + d + layer * 11) % 61).to(torch.bfloat16)
    v = ((t * 5 + p * 13 + h * 3 + d * 2 + layer * 17) % 59).to(torch.bfloat16) - 29
    return k, v


@dataclass
class Harness:
    """One scheduler + one worker connector over CPU KV tensors."""

    scheduler: Scheduler
    worker: ChunkStoreConnector
    kv: dict[str, torch.Tensor]
    group_of: dict[str, int]
    hash_block_size: int = BLOCK
    """Tokens one of a request's ``block_hashes`` spans."""
    finished: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    connector_stats: list[Any] = field(default_factory=list)
    """Per step, vLLM's ``connector_prefix_cache_stats`` (what feeds external_prefix_cache_*)."""

    @property
    def connector(self) -> ChunkStoreConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, ChunkStoreConnector)
        return connector

    def add(self, prompt: list[int], max_tokens: int = 4, **kwargs: Any) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        request = Request(
            f"r{next(_ids)}",
            list(prompt),
            params,
            None,
            block_hasher=get_request_block_hasher(self.hash_block_size, sha256),
            **kwargs,
        )
        self.scheduler.add_request(request)
        return request

    def step(self, sampled: int = 5) -> Any:
        """One scheduler step with the stand-in forward pass; returns the SchedulerOutput."""
        sched, worker = self.scheduler, self.worker
        out = sched.schedule()
        worker.bind_connector_metadata(out.kv_connector_metadata)
        if out.has_sync_kv_loads:
            worker.start_load_kv(None)
        computed = scheduled_starts(out)
        reqs = list(computed)
        sampled_ids = []
        for req_id in reqs:
            n = out.num_scheduled_tokens[req_id]
            request = sched.requests[req_id]
            self._forward(req_id, request, computed[req_id], n)
            done_prefill = computed[req_id] + n >= request.num_tokens
            sampled_ids.append([sampled] if done_prefill else [])
        if not out.has_sync_kv_loads:
            worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        errors = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
        worker.clear_connector_metadata()
        kv_out = KVConnectorOutput(
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=errors,
            kv_connector_stats=stats,
        )
        runner_out = ModelRunnerOutput(
            req_ids=reqs,
            req_id_to_index={r: i for i, r in enumerate(reqs)},
            sampled_token_ids=sampled_ids,
            kv_connector_output=kv_out,
        )
        engine_out = sched.update_from_output(out, runner_out)
        for outputs in engine_out.values():
            stats = outputs.scheduler_stats
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                self.connector_stats.append(stats.connector_prefix_cache_stats)
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
        self.steps += 1
        return out

    def _forward(
        self, req_id: str, request: Request, start: int, n: int, placeholder: int | None = None
    ) -> None:
        """Write the KV of positions ``[start, start + n)``; ``placeholder`` stands for tokens
        not yet in ``all_token_ids`` (sampled last step, under asynchronous scheduling)."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        known = list(request.all_token_ids[start : start + n])
        if placeholder is not None:
            known += [placeholder] * (n - len(known))
        tokens = torch.tensor(known)
        positions = torch.arange(start, start + n)
        for name, kv in self.kv.items():
            layer = int(name.split(".")[2])
            blocks = block_ids[self.group_of[name]]
            k, v = expected_kv(layer, positions, tokens)
            for j, pos in enumerate(range(start, start + n)):
                b = blocks[pos // BLOCK]
                if b == 0:
                    continue
                page = kv[b].view(HEADS, 2 * BLOCK * DIM)
                off = pos % BLOCK
                # CPU vec packing: K column-major [D, N], V row-major [N, D]
                page[:, torch.arange(DIM) * BLOCK + off] = k[:, j]
                page[:, BLOCK * DIM + off * DIM : BLOCK * DIM + (off + 1) * DIM] = v[:, j]

    def external_hits(self) -> tuple[int, dict[Any, int], int]:
        """(hits, hits by source, preempted hits) reported since the last call."""
        hits, preempted, by_source = 0, 0, {}
        for s in self.connector_stats:
            hits += s.hits
            preempted += s.preempted_hits
            for source, n in s.hits_by_source.items():
                by_source[source] = by_source.get(source, 0) + n
        self.connector_stats.clear()
        return hits, by_source, preempted

    def run(self, max_steps: int = 100) -> None:
        """Step until no request is left."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def device_kv_matches(
        self, request: Request, num_tokens: int, layers: tuple[str, ...] | None = None
    ) -> bool:
        """Whether the request's blocks hold the stand-in model's KV for its first tokens."""
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        tokens = torch.tensor(request.all_token_ids[:num_tokens])
        positions = torch.arange(num_tokens)
        n_blocks = num_tokens // BLOCK
        for name, kv in self.kv.items():
            if layers is not None and name not in layers:
                continue
            layer = int(name.split(".")[2])
            blocks = torch.tensor(block_ids[self.group_of[name]][:n_blocks], dtype=torch.long)
            k, v = CpuVecLayout(num_heads=HEADS, head_dim=DIM, block_size=BLOCK).gather(kv, blocks)
            ek, ev = expected_kv(layer, positions[: n_blocks * BLOCK], tokens[: n_blocks * BLOCK])
            if not (torch.equal(k, ek) and torch.equal(v, ev)):
                return False
        return True


def scheduled_starts(out: Any) -> dict[str, int]:
    """Request id -> tokens computed before this step, for every request a
    SchedulerOutput schedules (new ones first, in order)."""
    starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return starts


def make_harness(
    model_dir: Any,
    extra: dict[str, Any] | None = None,
    *,
    num_blocks: int = 128,
    policy: str = "recompute",
    sliding_window: int | None = None,
    max_batched: int = 512,
    kv_events: Any = None,
    hash_block_size: int = BLOCK,
) -> Harness:
    init_none_hash(sha256)
    model = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0, max_model_len=2048)
    sched_cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max_batched,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.kv_cache_layout = "LBHNC"
    transfer = KVTransferConfig(
        kv_connector="ChunkStoreConnector",
        kv_connector_module_path="chunkstore.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"chunk_tokens": 64, "host_cache": "16M", **(extra or {})},
        kv_load_failure_policy=policy,
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=sched_cfg,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
        kv_events_config=kv_events,
    )
    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16
    )
    if sliding_window is None:
        groups = [KVCacheGroupSpec(list(LAYERS), full)]
        group_of = {name: 0 for name in LAYERS}
    else:
        window = SlidingWindowSpec(
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_size=DIM,
            dtype=torch.bfloat16,
            sliding_window=sliding_window,
        )
        groups = [KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], window)]
        group_of = {LAYERS[0]: 0, LAYERS[1]: 1}
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )
    kv_cache_config.hash_block_size = hash_block_size  # as vLLM's engine core sets it
    config.cache_config.num_gpu_blocks = num_blocks
    worker = ChunkStoreConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    kv = {
        name: torch.zeros(num_blocks, HEADS, BLOCK, 2 * DIM, dtype=torch.bfloat16)
        for name in LAYERS
    }
    # The stand-in model writes vec pages; on an AMX CPU vLLM would pick amx for this shape.
    assert worker.worker is not None
    worker.worker.register_kv_caches(kv, cpu_isa="vec")
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        hash_block_size=hash_block_size,
        log_stats=True,
    )
    return Harness(scheduler, worker, kv, group_of, hash_block_size)


@contextlib.contextmanager
def harnesses(model_dir: Any) -> Iterator[Callable[..., Harness]]:
    """``make(**kwargs)`` building harnesses; their connectors are shut down on exit (the last
    one closes their shared store)."""
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = make_harness(model_dir, **kwargs)
        made.append(h)
        return h

    try:
        yield make
    finally:
        for h in made:
            shut_down(h)


def shut_down(h: Harness) -> None:
    """What vLLM does when the engine stops: the worker's connector, then the scheduler's."""
    h.worker.shutdown()
    h.connector.shutdown()
