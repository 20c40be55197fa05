"""PeerStore among the other parts: URL opening, as a TieredStore tier, chunks not for us."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.peer import PeerServer, PeerStore, open_peer_store
from chunkstore.testing.factories import sample_chunks
from chunkstore.tiering import TieredStore

pytestmark = pytest.mark.timeout(60)

CHUNKS = sample_chunks(5, seed=31)
KEYS = [c.key for c in CHUNKS]


def filled() -> MemoryStore:
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    return store


def test_open_peer_store_urls(serve: Callable[..., PeerServer]) -> None:
    server = serve(filled())
    hostport = server.endpoint.removeprefix("tcp://")
    store = open_peer_store(
        f"peer://{hostport}", plane="inline", timeout_s=3.0, use_env_secret=False
    )
    try:
        assert isinstance(store, PeerStore)
        assert store.config.timeout_s == 3.0
        assert store.lookup_prefix(KEYS) == len(KEYS)
    finally:
        store.close()


def test_peer_store_as_a_tier_behind_host_memory(
    plane: str, serve: Callable[..., PeerServer]
) -> None:
    server = serve(filled())
    peers = PeerStore(
        [server.endpoint], plane=plane, recv_arena_bytes=4 << 20, use_env_secret=False
    )
    tiered = TieredStore(
        HostCache(len(CHUNKS[0].data), num_slots=8, pin_memory=False), [peers], name="decode"
    )
    try:
        assert tiered.lookup_prefix(KEYS) == len(KEYS)
        assert [bytes(g or b"") for g in tiered.get_many(KEYS)] == [c.data for c in CHUNKS]
        assert tiered.host.exists_many(KEYS) == [True] * len(KEYS)  # promoted into host memory
    finally:
        tiered.close()


def test_chunks_of_another_model_are_misses_and_stay_on_the_peer(
    serve: Callable[..., PeerServer],
) -> None:
    backing = filled()
    server = serve(backing)  # serves any model
    store = PeerStore(
        [server.endpoint], plane="inline", fingerprint=b"\x05" * 32, use_env_secret=False
    )
    try:
        assert store.get(KEYS[0]) is None
        assert store.corrupt_detected == 0
        assert backing.exists(KEYS[0])  # not for us, but intact: not deleted
    finally:
        store.close()
