"""Faults become bounded misses: dead, stalled and hostile peers; leases free their pins."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.format import ChunkLayout
from chunkstore.peer import (
    PeerClient,
    PeerRefused,
    PeerServer,
    PeerStore,
    PeerUnavailable,
    open_registry,
)
from chunkstore.peer import _protocol as P
from chunkstore.testing.factories import sample_chunks, small_spec
from tests.peer import procs
from tests.peer.conftest import require_nixl
from tests.peer.doubles import RegisteredHostCache, SlowStore
from tests.peer.wire import raw_request, reply_of

pytestmark = pytest.mark.timeout(60)

CHUNKS = sample_chunks(4, seed=21)
KEYS = [c.key for c in CHUNKS]


def filled(store: Any) -> Any:
    store.put_many([(c.key, c.data) for c in CHUNKS])
    return store


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# --- dead and stalled peers ---------------------------------------------------------------


def test_stalled_peer_is_a_miss_then_marked_down(
    plane: str, serve: Callable[..., PeerServer]
) -> None:
    slow = filled(SlowStore())
    server = serve(slow)
    store = PeerStore(
        [server.endpoint],
        plane=plane,
        timeout_s=0.5,
        retry_after_s=60,
        recv_arena_bytes=4 << 20,
        use_env_secret=False,
    )
    try:
        assert store.exists(KEYS[0])  # exists does not read
        assert store.get(KEYS[0]) is None  # the read stalls past the timeout: a miss
        reads = slow.reads
        assert store.get(KEYS[1]) is None  # marked down: fails at once, the peer is not asked
        assert slow.reads == reads
        assert store.lookup_prefix(KEYS) == 0
    finally:
        slow.unblock.set()
        store.close()


def test_a_peer_leaving_discovery_costs_no_read_its_goodbye(
    serve: Callable[..., PeerServer], tmp_path: Path
) -> None:
    leaving = serve(MemoryStore(), planes=("inline",), name="leaving", handle_on_io_thread=False)
    staying = serve(filled(MemoryStore()), planes=("inline",), name="staying")
    goodbye, answer_goodbye = threading.Event(), threading.Event()
    assert leaving._handlers is not None
    ops = leaving._handlers._ops  # noqa: SLF001 - a server that never answers bye (it died)
    say_bye = ops["bye"]

    def stalled_bye(body: dict[str, Any], data: list[Any]) -> Any:
        goodbye.set()
        answer_goodbye.wait(30)
        return say_bye(body, data)

    ops["bye"] = stalled_bye
    registry = open_registry(str(tmp_path))
    for server in (leaving, staying):
        registry.announce(server.info(), 60)
    store = PeerStore(
        open_registry(str(tmp_path)),
        plane="inline",
        timeout_s=30,
        refresh_s=0,
        use_env_secret=False,
    )
    try:
        assert store.lookup_prefix(KEYS) == len(KEYS)  # a session with each
        registry.withdraw("leaving")
        answered = threading.Event()
        reader = threading.Thread(
            target=lambda: store.lookup_prefix(KEYS) == len(KEYS) and answered.set()
        )
        reader.start()
        assert goodbye.wait(10)  # the client of the departed peer says goodbye...
        reader.join(10)
        assert answered.is_set()  # ...while the read that noticed the departure has returned
    finally:
        answer_goodbye.set()
        store.close()


def test_late_reply_is_not_taken_for_the_next_answer(serve: Callable[..., PeerServer]) -> None:
    slow = filled(SlowStore())
    server = serve(slow)
    client = PeerClient(
        server.endpoint, plane="inline", timeout_s=0.3, retry_after_s=0, use_env_secret=False
    )
    try:
        with pytest.raises(PeerUnavailable):
            client.fetch([KEYS[0]])
        slow.unblock.set()
        assert client.fetch([KEYS[1]]) == [CHUNKS[1].data]
        assert client.fetch([KEYS[2], KEYS[0]]) == [CHUNKS[2].data, CHUNKS[0].data]
    finally:
        client.close()


def _serve_slow(conn: Any) -> None:
    """A server process whose reads block forever (it gets killed mid-request)."""
    server = PeerServer(filled(SlowStore()), staging_bytes=4 << 20, use_env_secret=False).start()
    conn.send(server.endpoint)
    time.sleep(60)


def test_server_killed_mid_request_is_a_bounded_miss(plane: str) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_slow, args=(child,))
    proc.start()
    try:
        assert parent.poll(60)
        endpoint = parent.recv()
        store = PeerStore(
            [endpoint], plane=plane, timeout_s=1.0, recv_arena_bytes=4 << 20, use_env_secret=False
        )
        assert store.lookup_prefix(KEYS) == len(KEYS)
        killer = threading.Timer(0.3, proc.kill)
        killer.start()
        assert store.get_many(KEYS) == [None] * len(KEYS)
        killer.join()
        proc.join(10)
        assert store.get(KEYS[0]) is None
        assert store.corrupt_detected == 0
        store.close()
    finally:
        if proc.is_alive():
            proc.kill()


def test_server_killed_between_lease_and_read_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    require_nixl()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=procs.prefill_server, args=(child, 21, 4, "host", {}, 16))
    proc.start()
    try:
        assert parent.poll(60)
        _, endpoint, pid, _ = parent.recv()
        client = PeerClient(
            endpoint, plane="nixl", timeout_s=5, recv_arena_bytes=4 << 20, use_env_secret=False
        )
        assert client.fetch(KEYS[:1]) == [CHUNKS[0].data]
        assert client._nixl is not None
        real_read = client._nixl.endpoint.read

        def read_after_death(*args: Any) -> bool:
            os.kill(pid, signal.SIGKILL)
            proc.join(10)
            return real_read(*args)

        monkeypatch.setattr(client._nixl.endpoint, "read", read_after_death)
        with pytest.raises(PeerUnavailable):
            client.fetch(KEYS)
        assert not client.available
        client.close()
    finally:
        if proc.is_alive():
            proc.kill()


# --- hostile input ---------------------------------------------------------------------------


def test_garbage_and_oversized_frames_never_crash_the_server(
    serve: Callable[..., PeerServer],
) -> None:
    limits = P.Limits(max_control_bytes=4096, max_frame_bytes=1 << 20)
    server = serve(filled(MemoryStore()), limits=limits)
    host, port = server.endpoint.removeprefix("tcp://").split(":")
    # not ZMTP at all: the handshake fails
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
        time.sleep(0.1)
    # ZMTP, but not msgpack
    assert reply_of(raw_request(server.endpoint, [b"\xc1\xc1garbage", b""]))["error"] == P.MALFORMED
    # a single frame (no tag frame)
    assert reply_of(raw_request(server.endpoint, [b"x"]))["error"] == P.MALFORMED
    # msgpack, but not a map / missing fields / wrong types / unknown op
    for body in (
        [1, 2],
        {"v": 1},
        {"v": 1, "id": 1, "op": "lookup", "s": b"x", "keys": 5},
        {"v": 1, "id": 1, "op": "frobnicate"},
    ):
        reply = reply_of(raw_request(server.endpoint, [msgpack.packb(body), b""]))
        assert reply["ok"] is False and reply["error"] in (P.MALFORMED, P.UNKNOWN_OP)
    # an oversized control frame is refused and counted
    big = msgpack.packb({"v": 1, "id": 2, "op": "stats", "s": b"x" * 8192})
    assert reply_of(raw_request(server.endpoint, [big, b""]))["error"] == P.TOO_LARGE
    # a frame above ZMQ_MAXMSGSIZE: libzmq drops the connection, nothing reaches Python
    assert raw_request(server.endpoint, [b"\x80", b"", b"x" * (2 << 20)], timeout_ms=500) is None
    # a session that was never opened
    reply = reply_of(
        raw_request(
            server.endpoint,
            [msgpack.packb({"v": 1, "id": 3, "op": "lookup", "s": b"0" * 16, "keys": b""}), b""],
        )
    )
    assert reply["error"] == P.NO_SESSION
    wait_for(lambda: server.stats()["counts"].get("rejected_handshake_failed", 0) >= 1)
    counts = server.stats()["counts"]
    assert counts["rejected_malformed"] >= 5
    assert counts["rejected_too_large"] == 1
    assert counts["rejected_no_session"] == 1
    # and it still serves
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    assert client.fetch(KEYS[:2]) == [c.data for c in CHUNKS[:2]]
    client.close()


def test_wrong_protocol_version_is_refused_with_the_supported_list(
    serve: Callable[..., PeerServer],
) -> None:
    server = serve(MemoryStore())
    hello = {
        "v": 99,
        "id": 1,
        "op": "hello",
        "versions": [99],
        "client": "future",
        "fingerprint": None,
        "chunk_tokens": None,
        "planes": ["inline"],
        "nixl_md": None,
    }
    reply = reply_of(raw_request(server.endpoint, [msgpack.packb(hello), b""]))
    assert reply["error"] == P.UNSUPPORTED_VERSION and reply["versions"] == [1]
    hello["v"] = 1  # speaks v1 framing but offers only a future version
    reply = reply_of(raw_request(server.endpoint, [msgpack.packb(hello), b""]))
    assert reply["error"] == P.UNSUPPORTED_VERSION
    assert server.stats()["counts"]["rejected_unsupported_version"] == 2


def test_wrong_model_fingerprint_or_chunk_size_is_refused(serve: Callable[..., PeerServer]) -> None:
    server = serve(filled(MemoryStore()), fingerprint=b"\x01" * 32, chunk_tokens=16)
    with pytest.raises(PeerRefused) as refused:
        PeerClient(server.endpoint, fingerprint=b"\x02" * 32, use_env_secret=False).hello()
    assert refused.value.code == P.FINGERPRINT_MISMATCH
    with pytest.raises(PeerRefused) as refused:
        PeerClient(server.endpoint, chunk_tokens=256, use_env_secret=False).hello()
    assert refused.value.code == P.CHUNK_TOKENS_MISMATCH
    store = PeerStore([server.endpoint], fingerprint=b"\x02" * 32, use_env_secret=False)
    assert store.lookup_prefix(KEYS) == 0 and store.get(KEYS[0]) is None
    store.close()
    right = PeerClient(
        server.endpoint,
        fingerprint=b"\x01" * 32,
        chunk_tokens=16,
        plane="inline",
        use_env_secret=False,
    )
    assert right.lookup(KEYS) == len(KEYS)
    right.close()


@pytest.mark.parametrize(
    ("server_secret", "client_secret"), [("right", "wrong"), ("right", None), (None, "right")]
)
def test_wrong_auth_key_is_refused(
    serve: Callable[..., PeerServer], server_secret: str | None, client_secret: str | None
) -> None:
    server = serve(filled(MemoryStore()), secret=server_secret)
    client = PeerClient(server.endpoint, secret=client_secret, plane="inline", use_env_secret=False)
    with pytest.raises(PeerRefused) as refused:
        client.lookup(KEYS)
    assert refused.value.code == P.AUTH_FAILED
    client.close()
    if server_secret is not None:
        assert server.stats()["counts"]["rejected_auth_failed"] == 1
        good = PeerClient(
            server.endpoint, secret=server_secret, plane="inline", use_env_secret=False
        )
        assert good.fetch(KEYS[:1]) == [CHUNKS[0].data]
        good.close()


def test_tampered_message_fails_authentication() -> None:
    codec = P.Codec(b"key")
    frames = codec.encode({"v": 1, "id": 1, "op": "stats", "s": b"x"}, [b"data"], reply=False)
    assert codec.decode(frames, reply=False)[2] is True
    assert codec.decode(frames, reply=True)[2] is False  # a request cannot pass as a reply
    frames[2] = b"dbta"
    assert codec.decode(frames, reply=False)[2] is False
    assert P.Codec(b"other").decode(frames[:2], reply=False)[2] is False


def test_curve_encryption(serve: Callable[..., PeerServer]) -> None:
    public, secret = zmq.curve_keypair()
    server = serve(filled(MemoryStore()), curve_public_key=public, curve_secret_key=secret)
    client = PeerClient(
        server.endpoint, curve_server_key=public, plane="inline", use_env_secret=False
    )
    assert client.fetch(KEYS[:2]) == [c.data for c in CHUNKS[:2]]
    client.close()
    plain = PeerClient(server.endpoint, plane="inline", timeout_s=0.5, use_env_secret=False)
    with pytest.raises(PeerUnavailable):
        plain.lookup(KEYS)
    plain.close()


def test_curve_client_allow_list(serve: Callable[..., PeerServer]) -> None:
    public, secret = zmq.curve_keypair()
    allowed_pub, allowed_sec = zmq.curve_keypair()
    server = serve(
        filled(MemoryStore()),
        curve_public_key=public,
        curve_secret_key=secret,
        curve_client_keys=(allowed_pub,),
    )
    good = PeerClient(
        server.endpoint,
        curve_server_key=public,
        curve_public_key=allowed_pub,
        curve_secret_key=allowed_sec,
        plane="inline",
        use_env_secret=False,
    )
    assert good.lookup(KEYS) == len(KEYS)
    good.close()
    stranger = PeerClient(
        server.endpoint,
        curve_server_key=public,
        plane="inline",
        timeout_s=0.5,
        use_env_secret=False,
    )
    with pytest.raises(PeerUnavailable):
        stranger.lookup(KEYS)
    stranger.close()


def test_read_only_peer_refuses_push_and_delete(serve: Callable[..., PeerServer]) -> None:
    server = serve(filled(MemoryStore()), read_only=True)
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    with pytest.raises(PeerRefused):
        client.push([(CHUNKS[0].key, CHUNKS[0].data)])
    with pytest.raises(PeerRefused) as refused:
        client.delete(KEYS)
    assert refused.value.code == P.READ_ONLY
    client.close()


def test_corrupt_push_is_refused(plane: str, serve: Callable[..., PeerServer]) -> None:
    backing = MemoryStore()
    server = serve(backing)
    client = PeerClient(
        server.endpoint, plane=plane, recv_arena_bytes=4 << 20, use_env_secret=False
    )
    damaged = bytearray(CHUNKS[0].data)
    damaged[-1] ^= 1
    assert client.push(
        [(KEYS[0], bytes(damaged)), (KEYS[1], CHUNKS[0].data), (KEYS[2], CHUNKS[2].data)]
    ) == [False, False, True]
    assert backing.exists_many(KEYS[:3]) == [False, False, True]
    assert server.stats()["counts"]["pushed_corrupt"] == 2
    client.close()


# --- leases -----------------------------------------------------------------------------------


def test_lease_expiry_frees_pins(serve: Callable[..., PeerServer]) -> None:
    require_nixl()
    cache = filled(RegisteredHostCache(len(CHUNKS[0].data), num_slots=8, pin_memory=False))
    server = serve(cache)
    client = PeerClient(
        server.endpoint, plane="nixl", recv_arena_bytes=4 << 20, use_env_secret=False
    )
    # a client that asks for a lease and then never reads or releases (it "died")
    reply, _ = client.request(
        "fetch", {"keys": P.pack_keys(KEYS), "plane": "nixl", "lease_ms": 300}
    )
    assert all(item is not None for item in reply["items"])
    assert server.stats()["pins"] == len(KEYS)
    assert cache.stats().pinned_slots == len(KEYS)
    wait_for(lambda: server.stats()["pins"] == 0)
    assert cache.stats().pinned_slots == 0
    assert server.stats()["counts"]["leases_expired"] == 1
    # leases are clamped to the server's maximum
    reply, _ = client.request(
        "fetch", {"keys": P.pack_keys(KEYS[:1]), "plane": "nixl", "lease_ms": 10**9}
    )
    assert reply["lease_ms"] == server.config.max_lease_ms
    client.request("release", {"lease": reply["lease"], "ack": True})
    assert cache.stats().pinned_slots == 0
    with pytest.raises(PeerRefused) as refused:
        client.request("release", {"lease": reply["lease"], "ack": True})
    assert refused.value.code == P.UNKNOWN_LEASE
    client.close()


def test_a_client_that_stops_reading_cannot_pin_past_the_lease_maximum(
    serve: Callable[..., PeerServer],
) -> None:
    # Chunks above ZeroMQ's copy threshold (64 KiB) are sent from the pinned slots themselves.
    layout = ChunkLayout(small_spec(chunk_tokens=64, num_layers=4, num_kv_heads=8, head_dim=64))
    chunks = sample_chunks(4, seed=8, layout=layout)
    cache = HostCache(len(chunks[0].data), num_slots=8, pin_memory=False)
    cache.put_many([(c.key, c.data) for c in chunks])
    server = serve(cache, planes=("inline",), default_lease_ms=200, max_lease_ms=400)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    keys = P.pack_keys([c.key for c in chunks])
    reader = ctx.Process(target=procs.stalled_reader, args=(there, server.endpoint, keys, 100))
    reader.start()
    try:
        assert here.poll(30) and here.recv() == "sent"
        # its replies (400 chunks, 200 MiB) back up in its connection, their chunks pinned...
        wait_for(lambda: server.stats()["inline_pins"] > 0)
        assert cache.stats().pinned_slots > 0
        # ...until the longest lease has passed: then the server lets go, connection or not
        wait_for(lambda: cache.stats().pinned_slots == 0)
        assert server.stats()["inline_pins"] == 0
        assert server.stats()["counts"]["inline_pins_expired"] > 0
        assert reader.is_alive()
    finally:
        reader.kill()
        reader.join()


def test_goodbye_and_idle_sessions_free_pins(serve: Callable[..., PeerServer]) -> None:
    require_nixl()
    cache = filled(RegisteredHostCache(len(CHUNKS[0].data), num_slots=8, pin_memory=False))
    server = serve(cache, session_idle_s=0.3)
    client = PeerClient(
        server.endpoint, plane="nixl", recv_arena_bytes=4 << 20, use_env_secret=False
    )
    client.request("fetch", {"keys": P.pack_keys(KEYS), "plane": "nixl", "lease_ms": 30_000})
    client.close()  # says bye: its leases go at once
    assert cache.stats().pinned_slots == 0
    other = PeerClient(
        server.endpoint, plane="nixl", recv_arena_bytes=4 << 20, use_env_secret=False
    )
    other.request("fetch", {"keys": P.pack_keys(KEYS), "plane": "nixl", "lease_ms": 30_000})
    assert cache.stats().pinned_slots == len(KEYS)
    wait_for(lambda: server.stats()["sessions"] == 0)  # idle session dropped, leases with it
    assert cache.stats().pinned_slots == 0
    assert other.lookup(KEYS) == len(KEYS)  # the client says hello again transparently
    other.close()


def test_a_closed_client_opens_no_new_session(serve: Callable[..., PeerServer]) -> None:
    # A fetch still running when its store closed sends its lease's release afterwards:
    # that must not say hello again (a session, a socket and, for a client owning its NIXL
    # plane, a whole new agent that nobody closes).
    server = serve(MemoryStore())
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    assert client.fetch(KEYS[:1]) == [None]
    client.close()
    with pytest.raises(PeerUnavailable):
        client.request("release", {"lease": b"\0" * 16, "ack": False}, expect_reply=False)
    with pytest.raises(PeerUnavailable):
        client.hello()
    assert not client.session_open
