"""Discovery: static lists, a registry directory and Redis, with heartbeats and expiry."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends.memory import MemoryStore
from chunkstore.backends.peer import (
    Announcer,
    FileRegistry,
    PeerInfo,
    PeerServer,
    PeerStore,
    RedisRegistry,
    StaticPeers,
    open_registry,
)
from chunkstore.errors import ConfigError
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import sample_chunks, small_spec

pytestmark = pytest.mark.timeout(60)

CHUNKS = sample_chunks(3, seed=4)
FINGERPRINT = ChunkLayout(small_spec()).fingerprint


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_static_peers() -> None:
    peers = StaticPeers(["127.0.0.1:5000", "tcp://127.0.0.1:5001"]).peers()
    assert [p.endpoint for p in peers] == ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]


def test_peer_info_round_trip() -> None:
    info = PeerInfo(
        "a",
        "tcp://127.0.0.1:1",
        fingerprint="ab",
        chunk_tokens=256,
        planes=("nixl", "inline"),
        extra={"role": "prefill"},
    )
    assert PeerInfo.from_json(info.to_json()) == info
    with pytest.raises(ValueError):
        PeerInfo.from_json("[1]")


def registries(tmp_path: Path, redis_url: str | None) -> Any:
    if redis_url is None:
        return FileRegistry(tmp_path / "registry")
    return RedisRegistry(redis_url, prefix=f"test:{tmp_path.name}:")


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_announce_heartbeat_expire_withdraw(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url") if kind == "redis" else None
    registry = registries(tmp_path, url)
    alive = PeerInfo("alive", "tcp://127.0.0.1:1")
    crashed = PeerInfo("crashed", "tcp://127.0.0.1:2")
    announcer = Announcer(registry, alive, interval_s=0.1, ttl_s=0.5).start()
    registry.announce(crashed, 0.3)  # announced once, then its heartbeat stops
    assert {p.name for p in registry.peers()} == {"alive", "crashed"}
    wait_for(lambda: {p.name for p in registry.peers()} == {"alive"})
    time.sleep(0.6)  # several TTLs: the heartbeat keeps "alive" listed
    assert [p.name for p in registry.peers()] == ["alive"]
    announcer.stop()
    assert registry.peers() == []


def test_file_registry_ignores_junk_and_cleans_long_dead(tmp_path: Path) -> None:
    registry = FileRegistry(tmp_path, cleanup_after_s=0)
    (tmp_path / "junk.peer.json").write_text("{not json")
    registry.announce(PeerInfo("old", "tcp://127.0.0.1:3"), -1)
    assert registry.peers() == []
    assert not (tmp_path / "old.peer.json").exists()


def test_open_registry() -> None:
    assert isinstance(open_registry("/tmp/x"), FileRegistry)
    assert isinstance(open_registry("file:///tmp/x"), FileRegistry)
    with pytest.raises(ConfigError):
        open_registry("ftp://nope")


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_peer_store_follows_the_registry(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_url") if kind == "redis" else None
    registry = registries(tmp_path, url)
    backing = MemoryStore()
    backing.put_many([(c.key, c.data) for c in CHUNKS])
    keys = [c.key for c in CHUNKS]
    other_model = PeerInfo("other", "tcp://127.0.0.1:9", fingerprint="00" * 32)
    registry.announce(other_model, 30)
    with PeerServer(
        backing, staging_bytes=4 << 20, use_env_secret=False, fingerprint=FINGERPRINT
    ) as server:
        announcer = Announcer(registry, server.info, interval_s=0.2).start()
        store = PeerStore(
            registry, fingerprint=FINGERPRINT, plane="inline", refresh_s=0, use_env_secret=False
        )
        try:
            # the server with another model fingerprint is never contacted
            assert [c.endpoint for c in store.clients()] == [server.endpoint]
            assert store.lookup_prefix(keys) == 3
            assert store.get(keys[1]) == CHUNKS[1].data
            announcer.stop()
            assert store.clients() == [] and store.get(keys[1]) is None
        finally:
            store.close()
