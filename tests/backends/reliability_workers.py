"""Worker processes for test_reliability.py (importable by the forkserver)."""

from __future__ import annotations

import random
from typing import Any

from chunkstore.backends._fs import FsStore
from chunkstore.format import ChunkLayout, decode_chunk, encode_chunk
from chunkstore.testing.factories import MadeChunk, kv_tensors, sample_chunks, small_spec

BIG = ChunkLayout(small_spec(chunk_tokens=64, num_layers=4, num_kv_heads=8, head_dim=64))
"""About 1 MiB per chunk, so a kill often lands inside a write."""


def chunk_versions(count: int, seed: int) -> list[tuple[MadeChunk, bytes]]:
    """Chunks with a second, different but valid encoding under the same key."""
    alt_layout = ChunkLayout(small_spec(num_kv_heads=2))
    out = []
    for chunk in sample_chunks(count, seed=seed):
        alt = encode_chunk(
            alt_layout,
            key=chunk.key.digest,
            parent=chunk.parent,
            namespace=chunk.key.namespace,
            tokens=chunk.tokens,
            tensors=kv_tensors(alt_layout, chunk.tokens),
        )
        out.append((chunk, bytes(alt)))
    return out


def endless_writer(root: str, counter: Any, seed: int) -> None:
    """Write big chunks forever (until killed), counting completed puts."""
    store = FsStore(root, create=True)
    chunks = sample_chunks(6, seed=seed, layout=BIG)
    rng = random.Random(seed)
    while True:
        chunk = rng.choice(chunks)
        if rng.random() < 0.5:
            store.put(chunk.key, chunk.data)
        else:
            store.put_if_absent(chunk.key, chunk.data)
        if rng.random() < 0.2:
            store.delete(chunk.key)
        with counter.get_lock():
            counter.value += 1


def mixed_worker(root: str, seed: int, rounds: int) -> dict[str, int]:
    """Write, overwrite (two valid versions), delete and read shared keys; check every read."""
    store = FsStore(root, create=True, access_resolution=0)
    versions = chunk_versions(8, seed=99)
    allowed = {c.key: {c.data, alt} for c, alt in versions}
    rng = random.Random(seed)
    reads = hits = 0
    for _ in range(rounds):
        chunk, alt = rng.choice(versions)
        action = rng.random()
        if action < 0.3:
            store.put(chunk.key, rng.choice([chunk.data, alt]))
        elif action < 0.4:
            store.put_if_absent(chunk.key, chunk.data)
        elif action < 0.5:
            store.delete(chunk.key)
        else:
            reads += 1
            data = store.get(chunk.key)
            if data is not None:
                hits += 1
                if bytes(data) not in allowed[chunk.key]:
                    raise AssertionError("read bytes that no writer wrote")
                decode_chunk(data, expected_key=chunk.key.digest)
            buf = bytearray(len(chunk.data) + 4096)
            size = store.get_into(chunk.key, buf)
            if size is not None and bytes(buf[:size]) not in allowed[chunk.key]:
                raise AssertionError("get_into returned bytes that no writer wrote")
    return {"reads": reads, "hits": hits, "corrupt": store.corrupt_detected}


def capped_writer(root: str, seed: int, max_bytes: int, count: int) -> int:
    """Put ``count`` distinct chunks into a capped store; after each, check the cap holds."""
    store = FsStore(root, create=True, max_bytes=max_bytes, access_resolution=0)
    assert store.capacity is not None
    worst = 0
    for chunk in sample_chunks(count, seed=seed):
        store.put(chunk.key, chunk.data)
        if seed % 2:
            store.get(chunk.key)
        with store.io.lock(store.capacity.lock_path):  # a consistent view of every writer
            worst = max(worst, sum(info.size for info in store.list()))
    return worst
