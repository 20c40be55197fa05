"""Simulated TP rank processes for the shard-assembly tests.

Every rank process rebuilds the same conversation from a seed (the factories
are deterministic), holds only its heads of each chunk (``shard_of``), and
writes or reads them through a :class:`ShardAssembler` attached to the owner's
pool by name. Replies are plain tuples.
"""

from __future__ import annotations

import os
import random
from multiprocessing.queues import Queue
from typing import Any

import numpy as np

from chunkstore.cache import ShardAssembler
from chunkstore.format import MLA, ChunkLayout, KVSpec, LayerGroup
from chunkstore.testing.factories import (
    MadeChunk,
    conversation_tokens,
    kv_tensors,
    make_chunks,
    small_spec,
)

CHUNKS = 6
"""Chunks per test conversation."""


def layout_named(name: str) -> ChunkLayout:
    """``gqa``: 4 KV heads; ``rep``: 2 KV heads (replicated at TP=4); ``mla``: one latent."""
    if name == "gqa":
        return ChunkLayout(small_spec(num_kv_heads=4))
    if name == "rep":
        return ChunkLayout(small_spec(num_kv_heads=2))
    if name == "mla":
        return ChunkLayout(KVSpec("test/mla", "BF16", 16, (LayerGroup(MLA, (0, 1), 1, 32),)))
    raise ValueError(name)


def conversation(layout: ChunkLayout, seed: int) -> list[MadeChunk]:
    """The test conversation: CHUNKS chained chunks, encoded from whole tensors."""
    return make_chunks(layout, conversation_tokens(seed, CHUNKS * layout.spec.chunk_tokens))


def write_all(assembler: ShardAssembler, chunks: list[MadeChunk], order_seed: int) -> None:
    """Write this rank's shard of every chunk, in a shuffled order."""
    layout, rank, tp = assembler.layout, assembler.rank, assembler.tp
    order = list(range(len(chunks)))
    random.Random(order_seed * 1000 + rank).shuffle(order)
    for i in order:
        chunk = chunks[i]
        claim = assembler.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
        if claim is None:
            continue
        with claim:
            assembler.write_shard(
                claim, layout.shard_of(kv_tensors(layout, chunk.tokens), rank, tp)
            )


def read_all(assembler: ShardAssembler, chunks: list[MadeChunk]) -> bool:
    """Whether every chunk reads back as exactly this rank's heads."""
    layout, rank, tp = assembler.layout, assembler.rank, assembler.tp
    for chunk in chunks:
        got = assembler.read_shard(chunk.key)
        if got is None:
            return False
        want = layout.shard_of(kv_tensors(layout, chunk.tokens), rank, tp)
        if set(got) != set(want):
            return False
        for name, tensor in want.items():
            if got[name].shape != tensor.shape or got[name].tobytes() != tensor.tobytes():
                return False
    return True


def serve(commands: Queue[Any], replies: Queue[Any]) -> None:
    """Run commands until ``("exit",)``: ``write``/``read`` (pool, layout, seed, rank, tp)."""
    while True:
        command = commands.get(timeout=120)
        if command[0] == "exit":
            return
        op, pool, layout_name, seed, rank, tp = command
        layout = layout_named(layout_name)
        chunks = conversation(layout, seed)
        try:
            with ShardAssembler.attach(pool, layout, rank=rank, tp=tp, slot_wait=10.0) as asm:
                if op == "write":
                    write_all(asm, chunks, seed)
                    stats = asm.stats()
                    replies.put(("wrote", rank, stats.claimed + stats.joined, stats.sealed))
                else:
                    replies.put(("read", rank, read_all(asm, chunks)))
        except Exception as exc:  # reported to the test, which fails with the message
            replies.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def die_mid_write(pool: str, layout_name: str, seed: int, rank: int, tp: int) -> None:
    """Claim the first chunk, write half of this rank's bytes, and exit without marking it."""
    layout = layout_named(layout_name)
    chunk = conversation(layout, seed)[0]
    asm = ShardAssembler.attach(pool, layout, rank=rank, tp=tp)
    claim = asm.slot_for_write(chunk.key, parent=chunk.parent, tokens=chunk.tokens)
    assert claim is not None
    ranges = layout.rank_ranges(rank, tp, for_write=True)
    first = ranges[0]
    claim.view[first.offset : first.offset + first.length // 2] = np.full(
        first.length // 2, 0xAB, np.uint8
    ).tobytes()
    os._exit(3)
