"""Simulated TP ranks for the TP-assembly tests: the connector's worker code on CPU tensors.

Each rank process builds the engine description vLLM would give rank ``r`` of
``tp`` (its KV heads only), a paged KV cache holding exactly its heads of a
deterministic conversation, and runs :class:`ChunkStoreWorker` over a
:class:`RankCache` attached to the owner's shared pool: ``save`` writes its
heads into the chunks' shared slots, ``load`` reads them back into a zeroed
cache and checks them. Replies are plain tuples.
"""

from __future__ import annotations

import traceback
from multiprocessing.queues import Queue
from typing import Any

import torch

from chunkstore.format import ATTENTION, ChunkLayout, KVSpec, LayerGroup, rank_share
from chunkstore.tiering import ProcessCache, RankCache
from chunkstore.vllm.config import parse_config
from chunkstore.vllm.engine import EngineKV, LayerInfo
from chunkstore.vllm.metadata import ChunkLoad, ChunkSave, ChunkStoreMetadata
from chunkstore.vllm.testing import sample_prompt_ids
from chunkstore.vllm.worker import ChunkStoreWorker

HEADS = 4
DIM = 32
BLOCK = 32
CHUNK = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
BLOCK_IDS = (7, 3, 12, 5, 9, 1)
"""The conversation's blocks, in token order (3 chunks of 2 blocks), shuffled on purpose."""
NUM_BLOCKS = 16
TOKENS = sample_prompt_ids(3 * CHUNK, seed=77)


def engine_for(rank: int, tp: int) -> EngineKV:
    """What ``describe_engine`` derives for rank ``rank`` of ``tp`` (without a vLLM config)."""
    spec = KVSpec("tp-test/model", "BF16", CHUNK, (LayerGroup(ATTENTION, (0, 1), HEADS, DIM),))
    share = rank_share(rank, tp, HEADS)
    layers = {
        name: LayerInfo(name, i, 0, ATTENTION, share.start, share.stop, DIM, share.writer)
        for i, name in enumerate(LAYERS)
    }
    return EngineKV(spec, ChunkLayout(spec), layers, BLOCK, rank, tp, 1, None)


def full_kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's K and V for every token of the conversation, all heads: exact in bf16."""
    h = torch.arange(HEADS).view(HEADS, 1, 1)
    d = torch.arange(DIM).view(1, 1, DIM)
    p = torch.arange(len(TOKENS)).view(1, -1, 1)
    t = torch.tensor(TOKENS).view(1, -1, 1)
    k = ((t * 7 + p * 3 + h * 5 + d + layer * 11) % 61).to(torch.bfloat16)
    v = ((t * 5 + p * 13 + h * 3 + d * 2 + layer * 17) % 59).to(torch.bfloat16) - 29
    return k, v


def make_worker(store: Any, rank: int, tp: int) -> tuple[ChunkStoreWorker, dict[str, torch.Tensor]]:
    engine = engine_for(rank, tp)
    cfg = parse_config({"chunk_tokens": CHUNK}, block_size=BLOCK)
    worker = ChunkStoreWorker(engine, cfg, store)
    local = engine.layers[LAYERS[0]]
    heads = local.head_stop - local.head_start
    # FlashAttention's paged layout (NHD in memory), as TP ranks on GPUs hold it; as CPU
    # tensors so that no GPU is needed (and no vLLM import: the CPU backend asks vLLM).
    kv = {
        name: torch.zeros(NUM_BLOCKS, BLOCK, heads, 2 * DIM, dtype=torch.bfloat16).transpose(1, 2)
        for name in LAYERS
    }
    worker.register_kv_caches(kv, backends=dict.fromkeys(LAYERS, "FLASH_ATTN"))
    return worker, kv


def _chain(engine: EngineKV) -> list[tuple[Any, bytes]]:
    root = engine.root()
    keys = engine.keys(TOKENS, root)
    return [(key, keys[i - 1].digest if i else root) for i, key in enumerate(keys)]


def _blocks(i: int) -> tuple[tuple[int, ...], ...]:
    return (BLOCK_IDS[2 * i : 2 * i + 2],)


def fill(worker: ChunkStoreWorker, kv: dict[str, torch.Tensor]) -> None:
    """Put this rank's heads of the conversation into its blocks (as a forward pass would)."""
    blocks = torch.tensor(BLOCK_IDS, dtype=torch.long)
    for i, name in enumerate(LAYERS):
        info = worker.engine.layers[name]
        k, v = full_kv(i)
        heads = slice(info.head_start, info.head_stop)
        worker.layouts[name].scatter(kv[name], blocks, k[heads], v[heads])


def save(worker: ChunkStoreWorker) -> None:
    c = CHUNK
    saves = [
        ChunkSave("conv", key, parent, tuple(TOKENS[i * c : (i + 1) * c]), _blocks(i))
        for i, (key, parent) in enumerate(_chain(worker.engine))
    ]
    worker.wait_for_save(ChunkStoreMetadata(saves=saves))
    worker.drain()


def load_matches(worker: ChunkStoreWorker, kv: dict[str, torch.Tensor]) -> bool:
    """Load every chunk into the zeroed cache; whether it then holds exactly this rank's heads."""
    loads = [
        ChunkLoad("conv", key, _blocks(i), 0, False)
        for i, (key, _) in enumerate(_chain(worker.engine))
    ]
    worker.start_load_kv(ChunkStoreMetadata(loads=loads))
    worker.drain()
    if worker.take_load_errors():
        return False
    blocks = torch.tensor(BLOCK_IDS, dtype=torch.long)
    for i, name in enumerate(LAYERS):
        info = worker.engine.layers[name]
        k, v = full_kv(i)
        heads = slice(info.head_start, info.head_stop)
        got_k, got_v = worker.layouts[name].gather(kv[name], blocks)
        if not (torch.equal(got_k, k[heads]) and torch.equal(got_v, v[heads])):
            return False
    return True


def save_in_process(store: ProcessCache) -> None:
    """TP=1: the connector's in-process path (scheduler and worker share ``store``)."""
    worker, kv = make_worker(store, 0, 1)
    fill(worker, kv)
    save(worker)


def serve(commands: Queue[Any], replies: Queue[Any]) -> None:
    """Run ``(op, pool, rank, tp)`` commands until ``("exit",)``; op is save or load."""
    torch.set_num_threads(1)
    while True:
        command = commands.get()
        if command[0] == "exit":
            return
        op, pool, rank, tp = command
        try:
            store = RankCache(pool, engine_for(rank, tp).layout, rank=rank, tp=tp)
            try:
                worker, kv = make_worker(store, rank, tp)
                if op == "save":
                    fill(worker, kv)
                    save(worker)
                    replies.put(("ok", rank, worker.store.assembler().stats().sealed))
                else:
                    replies.put(("ok", rank, load_matches(worker, kv)))
            finally:
                store.close()
        except Exception:  # noqa: BLE001 - report to the test instead of hanging it
            replies.put(("error", rank, traceback.format_exc()))
