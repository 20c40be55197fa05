"""Both data planes give the same answers when a batch is larger than the client's NIXL arena:
NIXL reads and pushes it in rounds that fit, instead of missing what does not fit."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.format import ChunkLayout
from chunkstore.peer import PeerClient, PeerServer
from chunkstore.testing.factories import sample_chunks, small_spec
from tests.peer.conftest import require_nixl

pytestmark = pytest.mark.timeout(60)

# Chunks of 516 KiB: a 1 MiB arena holds one at a time (allocations are page aligned).
LAYOUT = ChunkLayout(small_spec(chunk_tokens=64, num_layers=4, num_kv_heads=8, head_dim=64))
CHUNKS = sample_chunks(4, seed=3, layout=LAYOUT)
KEYS = [c.key for c in CHUNKS]
ARENA = 1 << 20


def client_of(server: PeerServer, plane: str) -> PeerClient:
    return PeerClient(server.endpoint, plane=plane, recv_arena_bytes=ARENA, use_env_secret=False)


def test_a_batch_larger_than_the_arena_is_fetched_whole(
    plane: str, serve: Callable[..., PeerServer]
) -> None:
    assert 2 * len(CHUNKS[0].data) > ARENA
    backing = MemoryStore()
    backing.put_many([(c.key, c.data) for c in CHUNKS])
    client = client_of(serve(backing, staging_bytes=16 << 20), plane)
    try:
        assert client.fetch(KEYS) == [c.data for c in CHUNKS]
        buffers = [np.zeros(len(c.data) + 100, dtype=np.uint8) for c in CHUNKS]
        assert client.fetch_into(KEYS, buffers) == [len(c.data) for c in CHUNKS]
        assert [bytes(b[: len(c.data)]) for b, c in zip(buffers, CHUNKS)] == [
            c.data for c in CHUNKS
        ]
    finally:
        client.close()


def test_a_batch_larger_than_the_arena_is_pushed_whole(
    plane: str, serve: Callable[..., PeerServer]
) -> None:
    target = MemoryStore()
    client = client_of(serve(target, staging_bytes=16 << 20), plane)
    try:
        assert client.push([(c.key, c.data) for c in CHUNKS]) == [True] * len(CHUNKS)
        assert target.get_many(KEYS) == [c.data for c in CHUNKS]
    finally:
        client.close()


def test_a_chunk_larger_than_the_arena_is_a_miss_over_nixl(
    serve: Callable[..., PeerServer],
) -> None:
    require_nixl()
    backing = MemoryStore()
    backing.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    server = serve(backing, staging_bytes=16 << 20)
    small = PeerClient(
        server.endpoint, plane="nixl", recv_arena_bytes=256 << 10, use_env_secret=False
    )
    try:
        assert small.fetch(KEYS[:2]) == [None, None]
        assert small.push([(CHUNKS[2].key, CHUNKS[2].data)]) == [False]
        assert small.available  # a chunk that does not fit is no fault of the peer
    finally:
        small.close()
