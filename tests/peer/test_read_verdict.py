"""What a PeerStore does with each read verdict: only damage is counted and removed from peers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from chunkstore.backends._memory import MemoryStore
from chunkstore.peer import PeerMetrics, PeerServer, PeerStore
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies, newer_major_copy

pytestmark = pytest.mark.timeout(60)

CHUNK = sample_chunks(1, seed=9)[0]


def _failures(registry: CollectorRegistry, reason: str) -> float:
    return (
        registry.get_sample_value("chunkstore_peer_client_failures_total", {"reason": reason}) or 0
    )


def _read_once(
    serve: Callable[..., PeerServer], stored: bytes, **options: Any
) -> tuple[MemoryStore, PeerStore, CollectorRegistry]:
    backing = MemoryStore(verify=False)  # serves what it holds: the client's verdict decides
    backing.put(CHUNK.key, stored)
    server = serve(backing, planes=("inline",))
    store, registry = _reader(server, **options)
    try:
        assert store.get(CHUNK.key) is None
    finally:
        store.close()
    return backing, store, registry


def _reader(server: PeerServer, **options: Any) -> tuple[PeerStore, CollectorRegistry]:
    """A peer store reading from ``server`` inline, with its own metrics registry."""
    registry = CollectorRegistry()
    store = PeerStore(
        [server.endpoint],
        plane="inline",
        use_env_secret=False,
        metrics=PeerMetrics(registry),
        **options,
    )
    return store, registry


@pytest.mark.parametrize(
    "options", [{"fingerprint": b"\x07" * 32}, {"mac_key": b"k" * 32}], ids=["model", "mac"]
)
def test_a_chunk_not_for_us_is_refused_and_left_on_the_peer(
    serve: Callable[..., PeerServer], options: dict[str, Any]
) -> None:
    backing, store, registry = _read_once(serve, CHUNK.data, **options)
    assert store.corrupt_detected == 0
    assert _failures(registry, "refused_chunk") == 1 and _failures(registry, "corrupt") == 0
    assert backing.exists(CHUNK.key)


def test_a_newer_chunkstores_chunk_is_a_plain_miss(serve: Callable[..., PeerServer]) -> None:
    backing, store, registry = _read_once(serve, newer_major_copy(CHUNK))
    assert store.corrupt_detected == 0
    assert _failures(registry, "refused_chunk") == 0 and _failures(registry, "corrupt") == 0
    assert backing.exists(CHUNK.key)


def test_a_damaged_chunk_is_counted_and_removed_from_the_peer(
    serve: Callable[..., PeerServer],
) -> None:
    backing, store, registry = _read_once(serve, corrupt_copies(CHUNK)["bitflip"])
    assert store.corrupt_detected == 1
    assert _failures(registry, "corrupt") == 1 and _failures(registry, "refused_chunk") == 0
    assert not backing.exists(CHUNK.key)


@pytest.mark.parametrize("read", ["get", "get_into"])
def test_a_damaged_copy_is_removed_from_the_peer_that_sent_it_only(
    serve: Callable[..., PeerServer], read: str
) -> None:
    damaged, intact = MemoryStore(verify=False), MemoryStore()
    damaged.put(CHUNK.key, corrupt_copies(CHUNK)["bitflip"])
    intact.put(CHUNK.key, CHUNK.data)
    sender = serve(damaged, planes=("inline",))
    bystander = serve(intact, planes=("inline",))
    store = PeerStore([sender.endpoint, bystander.endpoint], plane="inline", use_env_secret=False)
    buffer = bytearray(len(CHUNK.data))
    try:
        # both hold it; with no location remembered, the first peer that has it is asked
        if read == "get":
            assert store.get(CHUNK.key) is None
        else:
            assert store.get_into(CHUNK.key, buffer) is None
        assert store.corrupt_detected == 1
        assert not damaged.exists(CHUNK.key)
        assert intact.exists(CHUNK.key)  # another peer's copy is not the damaged one
        assert store.get(CHUNK.key) == CHUNK.data
    finally:
        store.close()


def test_a_compressed_chunk_promoted_on_the_peer_keeps_its_mac(
    serve: Callable[..., PeerServer],
) -> None:
    """A peer serving a tiered store promotes the chunk from its cold tier into host memory
    and sends it from there: a zstd chunk keeps its MAC on the way, so a reader holding the
    key admits it (it used to be decompressed without its MAC, and refused as not ours)."""
    from chunkstore.cache import HostCache
    from chunkstore.format import ChunkLayout, recompress
    from chunkstore.testing.factories import conversation_tokens, make_chunks, small_spec
    from chunkstore.tiering import TieredStore

    mac_key = b"k" * 32
    layout = ChunkLayout(small_spec(), authenticated=True)
    [chunk] = make_chunks(layout, conversation_tokens(3, layout.spec.chunk_tokens), mac_key=mac_key)
    packed = recompress(chunk.data, "zstd", mac_key=mac_key)
    cold = MemoryStore()
    cold.put(chunk.key, packed)
    tiered = TieredStore(HostCache(layout, num_slots=4), [cold])
    store, registry = _reader(serve(tiered, planes=("inline",)), mac_key=mac_key)
    try:
        for _ in range(2):  # promoted by the first fetch, a host hit for the second
            assert store.get(chunk.key) == packed
        assert _failures(registry, "refused_chunk") == 0
    finally:
        store.close()
        tiered.close()
