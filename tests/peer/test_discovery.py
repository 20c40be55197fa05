"""Discovery: static lists, a registry directory and Redis, with heartbeats and expiry."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.errors import ConfigError, StoreError
from chunkstore.format import ChunkLayout
from chunkstore.peer import (
    Announcer,
    FileRegistry,
    PeerInfo,
    PeerServer,
    PeerStore,
    RedisRegistry,
    StaticPeers,
    open_registry,
)
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


@pytest.mark.parametrize(
    "record",
    [
        '{"name": "a", "endpoint": "tcp://h:1", "expires_at": "tomorrow"}',
        '{"name": "a", "endpoint": "tcp://h:1", "expires_at": NaN}',
        '{"name": "a", "endpoint": "tcp://h:1", "planes": "nixl"}',
        '{"name": "a", "endpoint": "tcp://h:1", "planes": [1]}',
        '{"name": "a", "endpoint": "tcp://h:1", "chunk_tokens": "256"}',
        '{"name": "a", "endpoint": "tcp://h:1", "capacity_bytes": true}',
        '{"name": "a", "endpoint": "tcp://h:1", "extra": []}',
        '{"name": "a", "endpoint": 5}',
        '{"name": "a", "endpoint": "tcp://h:1", "extra": {"pad": "' + "x" * (70 << 10) + '"}}',
    ],
)
def test_hostile_registry_records_are_skipped(tmp_path: Path, record: str) -> None:
    with pytest.raises(ValueError):
        PeerInfo.from_json(record)
    registry = FileRegistry(tmp_path)
    registry.announce(PeerInfo("good", "tcp://127.0.0.1:1"), ttl_s=60)
    (tmp_path / "bad.peer.json").write_text(record)
    assert [p.name for p in registry.peers()] == ["good"]  # the bad record never crashes it


def registries(tmp_path: Path, redis_url: str | None) -> Any:
    if redis_url is None:
        return FileRegistry(tmp_path / "registry")
    return RedisRegistry(redis_url, prefix=f"test:{tmp_path.name}:")


class FakeClock:
    """Wall-clock time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def names(registry: Any) -> set[str]:
    return {p.name for p in registry.peers()}


def test_file_registry_heartbeat_expire_withdraw(tmp_path: Path) -> None:
    # Time is a fake clock: expiry is exact, whatever the machine's load.
    clock = FakeClock()
    registry = FileRegistry(tmp_path / "registry", clock=clock)
    alive = PeerInfo("alive", "tcp://127.0.0.1:1")
    crashed = PeerInfo("crashed", "tcp://127.0.0.1:2")
    announcer = Announcer(registry, alive, interval_s=0.1, ttl_s=0.5)
    announcer.beat()
    registry.announce(crashed, 0.3)  # announced once, then its heartbeat stops
    assert names(registry) == {"alive", "crashed"}
    clock.now += 0.29
    assert names(registry) == {"alive", "crashed"}  # not yet
    clock.now += 0.02
    assert names(registry) == {"alive"}  # crashed is past its TTL
    for _ in range(10):  # ten heartbeats, 2 s: four TTLs, "alive" stays listed
        clock.now += 0.2
        announcer.beat()
        assert names(registry) == {"alive"}
    clock.now += 0.51  # heartbeat stopped without withdrawing (a crash): it lapses too
    assert names(registry) == set()
    announcer.beat()
    announcer.stop()  # a clean stop withdraws at once
    assert registry.peers() == []
    files = tmp_path / "registry"
    assert [p.name for p in files.glob("*.peer.json")] == ["crashed.peer.json"]  # dead, kept
    clock.now += registry.cleanup_after_s
    assert registry.peers() == [] and not list(files.glob("*.peer.json"))  # long dead: removed


def test_two_hosts_with_one_pid_announce_through_one_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two hosts share the registry over NFS; their servers happen to run with the same pid
    # and thread id (here: one process plays both) and announce the same name: host B
    # writes and renames its record while host A's is between its write and its rename.
    shared = tmp_path / "registry"
    host_a, host_b = FileRegistry(shared), FileRegistry(shared)
    a = PeerInfo("node", "tcp://10.0.0.1:1")
    b = PeerInfo("node", "tcp://10.0.0.2:1")
    rename = os.replace
    interleaved: list[str] = []

    def b_announces_first(src: Any, dst: Any) -> None:
        if not interleaved:
            interleaved.append(str(src))
            host_b.announce(b, 5.0)
        rename(src, dst)

    monkeypatch.setattr(os, "replace", b_announces_first)
    host_a.announce(a, 5.0)  # neither loses its temp file to the other
    monkeypatch.setattr(os, "replace", rename)
    assert interleaved and [p.endpoint for p in host_a.peers()] == [a.endpoint]
    assert [p.name for p in shared.iterdir()] == ["node.peer.json"]  # no temp file left


def test_a_failed_announce_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = FileRegistry(tmp_path / "registry")

    def no_rename(src: Any, dst: Any) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(StoreError, match="cannot write peer registry"):
        registry.announce(PeerInfo("node", "tcp://127.0.0.1:1"), 5.0)
    assert list((tmp_path / "registry").iterdir()) == []


def test_announcer_thread_keeps_beating(tmp_path: Path) -> None:
    beats: list[float] = []

    class Counting(FileRegistry):
        def announce(self, info: PeerInfo, ttl_s: float) -> None:
            beats.append(ttl_s)
            super().announce(info, ttl_s)

    registry = Counting(tmp_path)
    announcer = Announcer(registry, PeerInfo("a", "tcp://127.0.0.1:1"), interval_s=0.01).start()
    try:
        assert beats and beats[0] == pytest.approx(0.03)  # first beat synchronous, TTL 3 beats
        wait_for(lambda: len(beats) >= 4, timeout=30)  # the thread renews in the background
        assert names(registry) == {"a"}
    finally:
        announcer.stop()
    assert registry.peers() == []


def test_redis_registry_expire_heartbeat_withdraw(tmp_path: Path, redis_url: str) -> None:
    # Redis expires keys on its own clock, so this test polls with generous deadlines and
    # only asserts what the elapsed time it measured allows.
    registry = RedisRegistry(redis_url, prefix=f"test:{tmp_path.name}:")
    alive = PeerInfo("alive", "tcp://127.0.0.1:1")
    crashed = PeerInfo("crashed", "tcp://127.0.0.1:2")
    announcer = Announcer(registry, alive, interval_s=10, ttl_s=60)
    announcer.beat()
    started = time.monotonic()
    registry.announce(crashed, 0.3)  # announced once, then its heartbeat stops
    ttl_ms = registry._redis.pttl(registry.prefix + "crashed")
    listed = names(registry)
    assert ttl_ms == -2 or 0 < ttl_ms <= 300  # Redis holds it for its TTL (-2: already gone)
    if time.monotonic() - started < 0.3:  # only meaningful before its TTL can have run out
        assert listed == {"alive", "crashed"}
    assert "alive" in listed
    wait_for(lambda: names(registry) == {"alive"}, timeout=30)  # Redis expired it
    first = {p.name: p for p in registry.peers()}["alive"].expires_at
    time.sleep(0.01)
    announcer.beat()  # a heartbeat renews the record (and its Redis TTL)
    assert {p.name: p for p in registry.peers()}["alive"].expires_at > first
    assert 0 < registry._redis.pttl(registry.prefix + "alive") <= 60_000
    announcer.stop()
    assert registry.peers() == []
    registry.close()


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
        # a heartbeat far longer than the test: the record cannot lapse on a loaded machine
        announcer = Announcer(registry, server.info, interval_s=30).start()
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


def test_static_peers_keep_ipc_endpoints() -> None:
    peers = StaticPeers(["ipc:///run/chunkstore/node.sock"]).peers()
    assert [p.endpoint for p in peers] == ["ipc:///run/chunkstore/node.sock"]


def test_file_registry_tells_unreadable_from_empty(tmp_path: Path) -> None:
    assert FileRegistry(tmp_path / "not-yet").peers() == []  # nobody announced yet
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the directory should be")
    with pytest.raises(StoreError, match="cannot list"):
        FileRegistry(blocked).peers()


class FlakySource:
    """A discovery source that lists ``infos`` until ``down`` is set, then cannot be read."""

    def __init__(self, infos: list[PeerInfo]) -> None:
        self.infos = infos
        self.down = False
        self.reads = 0

    def peers(self) -> list[PeerInfo]:
        self.reads += 1
        if self.down:
            raise StoreError("registry unreachable")
        return list(self.infos)


def test_an_unreachable_registry_keeps_the_peers_known() -> None:
    backing = MemoryStore()
    backing.put_many([(c.key, c.data) for c in CHUNKS])
    with PeerServer(
        backing, staging_bytes=4 << 20, use_env_secret=False, fingerprint=FINGERPRINT
    ) as server:
        source = FlakySource([server.info()])
        store = PeerStore(
            source, fingerprint=FINGERPRINT, plane="inline", refresh_s=0, use_env_secret=False
        )
        try:
            assert [c.endpoint for c in store.clients()] == [server.endpoint]
            source.down = True
            # an outage is not an empty registry: the live peer is still read
            assert [c.endpoint for c in store.clients()] == [server.endpoint]
            assert store.get(CHUNKS[0].key) == CHUNKS[0].data
            source.down = False
            source.infos = []
            assert store.clients() == []  # readable again: the registry's word counts
        finally:
            store.close()


def test_an_unreachable_registry_is_not_asked_on_every_read() -> None:
    source = FlakySource([])
    source.down = True
    store = PeerStore(source, fingerprint=FINGERPRINT, refresh_s=3600, use_env_secret=False)
    try:
        for _ in range(5):
            assert store.clients() == []
            assert store.get(CHUNKS[0].key) is None
        assert source.reads == 1  # next read after refresh_s, not one (a timeout) per read
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_registry_entry_that_is_no_regular_file_is_skipped_without_waiting(
    tmp_path: Path, kind: str
) -> None:
    """Anyone who can write the registry can leave a FIFO named like a record: opening it
    waited for a writer, so every refresh of every PeerStore (and `chunkstore peers`) hung."""
    registry = FileRegistry(tmp_path)
    registry.announce(PeerInfo("good", "tcp://127.0.0.1:1"), ttl_s=60)
    odd = tmp_path / "odd.peer.json"
    os.mkfifo(odd) if kind == "fifo" else odd.mkdir()
    listed: list[list[PeerInfo]] = []
    reader = threading.Thread(target=lambda: listed.append(registry.peers()), daemon=True)
    reader.start()
    reader.join(timeout=10)
    waited = reader.is_alive()
    if waited and kind == "fifo":  # let the blocked open return before failing
        os.close(os.open(odd, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=10)
    assert not waited, "peers() waited on the FIFO"
    assert listed and [p.name for p in listed[0]] == ["good"]
