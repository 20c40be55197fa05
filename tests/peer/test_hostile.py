"""Hostile peers: every field is parsed against the grammar before it reaches the store,
sessions stay bounded under a flood, and the server keeps serving (its tiers stay up)."""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from chunkstore.backends._fs import FsStore
from chunkstore.backends._memory import MemoryStore
from chunkstore.backends.base import ChunkInfo
from chunkstore.cache import HostCache
from chunkstore.format import ChunkLayout
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.peer import PeerClient, PeerRefused, PeerServer
from chunkstore.peer import _protocol as P
from chunkstore.testing.factories import sample_chunks, small_spec
from chunkstore.tiering import TieredStore
from tests.peer.wire import Dealer, hello_body, raw_request, reply_of

pytestmark = pytest.mark.timeout(120)

LAYOUT = ChunkLayout(small_spec())
CHUNKS = sample_chunks(6, seed=41, layout=LAYOUT)
KEYS = [c.key for c in CHUNKS]
NS = KEYS[0].namespace


def unique(prefix: str) -> str:
    """A server name no other test uses (the peer metrics are process-wide, by server)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def rejected(server: PeerServer, code: str) -> float:
    """The server's ``chunkstore_peer_server_rejected_total`` for ``code``."""
    value = REGISTRY.get_sample_value(
        "chunkstore_peer_server_rejected_total", {"server": server.name, "reason": code}
    )
    return value or 0.0


class RecordingStore(MemoryStore):
    """A memory store that records every call that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        self.calls.append("read")
        return super()._read_many(keys)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.calls.append("exists")
        return super().exists_many(keys)

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        self.calls.append("lookup")
        return super().lookup_prefix(keys)

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        self.calls.append(f"list {namespace}")
        return super().list(namespace)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        self.calls.append("delete")
        return super().delete_many(keys)


# --- path-like and oversized fields --------------------------------------------------------


def test_list_outside_the_store_root_is_refused_and_the_tier_stays_up(
    tmp_path: Path, serve: Callable[..., PeerServer]
) -> None:
    disk = FsStore(str(tmp_path / "store"), create=True)
    disk.put_many([(c.key, c.data) for c in CHUNKS])
    # a sibling directory the server must never walk: it holds chunks of its own
    with FsStore(str(tmp_path / "sibling"), create=True) as sibling:
        sibling.put_many([(c.key, c.data) for c in sample_chunks(2, seed=42, layout=LAYOUT)])
    metrics = ChunkstoreMetrics(CollectorRegistry())
    tiered = TieredStore(HostCache(LAYOUT, num_slots=8), [disk], metrics=metrics, retry_after=60)
    server = serve(tiered, name=unique("list"))
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    try:
        for namespace in (f"../sibling/{NS}", f"{NS}/../../sibling/{NS}", "/etc", NS.upper()):
            with pytest.raises(PeerRefused) as refused:
                client.request("list", {"namespace": namespace, "after": None, "limit": 10})
            assert refused.value.code == P.MALFORMED and "namespace" in refused.value.reason
        assert rejected(server, P.MALFORMED) == 4
        assert server.stats()["counts"]["rejected_malformed"] == 4
        up = metrics.registry.get_sample_value("chunkstore_tier_up", {"tier": disk.name})
        assert up == 1.0 and tiered.tiers[0].up
        # disk-only chunks are still hits, and the real namespace still lists
        assert client.fetch(KEYS) == [c.data for c in CHUNKS]
        assert {info.key for info in client.list(NS)} == set(KEYS)
    finally:
        client.close()


SESSION = b"s" * P.SESSION_BYTES  # replaced by a real session in the test
BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    # (op, fields that replace valid ones, expected error code)
    ("lookup", {"keys": b"k" * 41}, P.MALFORMED),
    ("lookup", {"keys": b"k" * P.KEY_WIRE_BYTES * 9}, P.TOO_LARGE),
    ("exists", {"keys": b"k" * 39}, P.MALFORMED),
    ("exists", {"keys": b"k" * P.KEY_WIRE_BYTES * 9}, P.TOO_LARGE),
    ("delete", {"keys": b"k" * 80_001}, P.MALFORMED),
    ("fetch", {"keys": b"k" * 41}, P.MALFORMED),
    ("fetch", {"lease_ms": -1}, P.MALFORMED),
    ("fetch", {"plane": "inline" * 1000}, P.TOO_LARGE),
    ("release", {"lease": b"../" * 5}, P.MALFORMED),
    ("release", {"lease": b"l" * 100_000}, P.MALFORMED),
    ("push", {"sizes": [-1]}, P.MALFORMED),
    ("push", {"sizes": [1 << 40]}, P.TOO_LARGE),
    ("push", {"sizes": [1] * 9}, P.TOO_LARGE),
    ("push", {"addrs": [0]}, P.MALFORMED),
    ("push", {"addrs": [-4096]}, P.MALFORMED),
    ("push", {"mode": "../append"}, P.MALFORMED),
    ("reserve", {"keys": b"k" * 41}, P.MALFORMED),
    ("reserve", {"mode": "../append"}, P.MALFORMED),
    ("reserve", {"tp": 0}, P.MALFORMED),
    ("reserve", {"rank": 1 << 40}, P.MALFORMED),
    ("reserve", {"parents": b"p" * 33}, P.MALFORMED),
    ("reserve", {"tokens": [b"abc"]}, P.MALFORMED),
    ("commit", {"lease": b"../" * 5}, P.MALFORMED),
    ("commit", {"sizes": [-1]}, P.MALFORMED),
    ("list", {"namespace": f"../{NS}"}, P.MALFORMED),
    ("list", {"namespace": "0" * 100_000}, P.MALFORMED),
    ("list", {"namespace": ""}, P.MALFORMED),
    ("list", {"after": b"a" * 39}, P.MALFORMED),
    ("list", {"limit": 0}, P.MALFORMED),
    ("list", {"limit": -(1 << 40)}, P.MALFORMED),
    ("stats", {"s": b"s" * 17}, P.MALFORMED),
    ("bye", {"s": b"/" * 100_000}, P.MALFORMED),
    ("stats", {"id": True}, P.MALFORMED),
]
VALID: dict[str, dict[str, Any]] = {
    "lookup": {"keys": b""},
    "exists": {"keys": b""},
    "delete": {"keys": b""},
    "fetch": {"keys": b"", "plane": "inline", "lease_ms": 0},
    "release": {"lease": b"l" * P.LEASE_BYTES, "ack": True},
    "push": {"keys": b"", "sizes": [], "plane": "inline", "addrs": [], "mode": "if_absent"},
    "reserve": {"keys": b"", "plane": "shm", "mode": "if_absent"},
    "commit": {"lease": b"l" * P.LEASE_BYTES, "sizes": []},
    "list": {"namespace": None, "after": None, "limit": 10},
    "stats": {},
    "bye": {},
}
BAD_HELLOS: list[tuple[dict[str, Any], str]] = [
    ({"client": "c" * (P.MAX_CLIENT_NAME_BYTES + 1)}, P.TOO_LARGE),
    ({"client": "é" * P.MAX_CLIENT_NAME_BYTES}, P.TOO_LARGE),  # the cap counts UTF-8 bytes
    ({"client": "c" * (1 << 20)}, P.TOO_LARGE),
    ({"versions": [1] * 1000}, P.TOO_LARGE),
    ({"versions": ["1"]}, P.MALFORMED),
    ({"versions": [True]}, P.MALFORMED),
    ({"planes": ["inline"] * 1000}, P.TOO_LARGE),
    ({"planes": ["x" * 1000]}, P.MALFORMED),
    ({"planes": [7]}, P.MALFORMED),
    ({"fingerprint": b"f" * 31}, P.MALFORMED),
    ({"fingerprint": b"f" * 100_000}, P.MALFORMED),
    ({"chunk_tokens": 0}, P.MALFORMED),
    ({"chunk_tokens": -256}, P.MALFORMED),
    ({"chunk_tokens": 1 << 40}, P.MALFORMED),
    ({"nixl_md": b"m" * (P.MAX_NIXL_METADATA_BYTES + 1)}, P.TOO_LARGE),
    ({"slot_size": 0}, P.MALFORMED),
    ({"slot_size": True}, P.MALFORMED),
    ({"id": True}, P.MALFORMED),
]


def test_every_request_type_refuses_bad_fields_before_the_store(
    serve: Callable[..., PeerServer],
) -> None:
    assert {op for op, _, _ in BAD_FIELDS} | {"hello"} == set(P.REQUEST_FIELDS)
    backing = RecordingStore()
    backing.put_many([(c.key, c.data) for c in CHUNKS])
    server = serve(backing, limits=P.Limits(max_keys=8), name=unique("fields"))
    dealer = Dealer(server.endpoint)
    try:
        session = dealer.ask(hello_body())["s"]
        for op, fields, code in BAD_FIELDS:
            body = {"v": 1, "id": 5, "op": op, "s": session, **VALID[op], **fields}
            reply = dealer.ask(body)
            assert reply["ok"] is False, (op, fields)
            assert reply["error"] == code, (op, fields, reply["reason"])
            assert len(reply["reason"]) < 200  # the reply does not echo the hostile field
            assert reply["id"] == (0 if fields.get("id") is True else 5)
        for fields, code in BAD_HELLOS:
            reply = dealer.ask(hello_body(**fields))
            assert reply["ok"] is False and reply["error"] == code, (fields, reply["reason"])
        assert backing.calls == []  # nothing reached the store
        counts = server.stats()["counts"]
        codes = [c for *_, c in BAD_FIELDS] + [c for _, c in BAD_HELLOS]
        for code in (P.MALFORMED, P.TOO_LARGE):
            expected = codes.count(code)
            assert counts[f"rejected_{code}"] == expected
            assert rejected(server, code) == expected
        assert server.stats()["sessions"] == 1  # refused hellos leave nothing behind
    finally:
        dealer.close()
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    assert client.fetch(KEYS[:2]) == [c.data for c in CHUNKS[:2]]
    client.close()


# --- sessions ----------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident memory of this process (the in-process server's)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def test_session_flood_stays_bounded(serve: Callable[..., PeerServer]) -> None:
    server = serve(
        MemoryStore(),
        max_sessions=32,
        max_sessions_per_client=4,
        session_evict_idle_s=0.0,
        name=unique("flood"),
    )
    flood = Dealer(server.endpoint)
    try:
        # many identities: the server holds at most max_sessions, evicting the least recent
        for i in range(1500):
            reply = flood.ask(hello_body(id=i + 1, client=f"flood-{i}"))
            assert reply["ok"] is True
            assert server.stats()["sessions"] <= 32
        stats = server.stats()
        assert stats["sessions"] == 32 and stats["max_sessions"] == 32
        assert stats["session_bytes"] <= 32 * P.MAX_CLIENT_NAME_BYTES
        gauge = REGISTRY.get_sample_value(
            "chunkstore_peer_server_sessions", {"server": server.name}
        )
        assert gauge == 32
        evicted_full = REGISTRY.get_sample_value(
            "chunkstore_peer_server_sessions_evicted_total",
            {"server": server.name, "cause": "full"},
        )
        assert evicted_full == 1500 - 32
        # one identity saying hello over and over keeps at most max_sessions_per_client
        before = server.stats()["counts"].get("sessions_evicted_per_client", 0)
        for i in range(200):
            assert flood.ask(hello_body(id=i + 1, client="same"))["ok"] is True
        counts = server.stats()["counts"]
        assert counts["sessions_evicted_per_client"] - before == 200 - 4
    finally:
        flood.close()
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    assert client.lookup([]) == 0 and server.stats()["sessions"] <= 32
    client.close()


def test_huge_hello_fields_do_not_grow_memory(serve: Callable[..., PeerServer]) -> None:
    server = serve(MemoryStore())
    # just under the 1 MiB control frame limit, so only the field cap refuses it
    big = msgpack.packb(hello_body(client="n" * ((1 << 20) - 4096)), use_bin_type=True)
    assert len(big) < P.Limits().max_control_bytes
    flood = Dealer(server.endpoint)
    try:
        flood.ask(hello_body())  # warm up buffers and metric children
        gc.collect()
        before = rss_bytes()
        for _ in range(200):  # before the caps, each one kept ~1 MiB for good
            flood.sock.send_multipart([big, b""])
            assert flood.sock.poll(5000)
            assert reply_of(flood.sock.recv_multipart())["error"] == P.TOO_LARGE
        gc.collect()
        grown = rss_bytes() - before
    finally:
        flood.close()
    assert server.stats()["sessions"] == 1 and server.stats()["session_bytes"] < 64
    assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"


def test_a_full_server_refuses_when_no_session_is_idle(serve: Callable[..., PeerServer]) -> None:
    server = serve(MemoryStore(), max_sessions=3, session_evict_idle_s=3600.0, name=unique("full"))
    dealer = Dealer(server.endpoint)
    try:
        for i in range(3):
            assert dealer.ask(hello_body(client=f"c{i}"))["ok"] is True
        reply = dealer.ask(hello_body(client="late"))
        assert reply["ok"] is False and reply["error"] == P.TOO_MANY_SESSIONS
        assert rejected(server, P.TOO_MANY_SESSIONS) == 1
        assert server.stats()["sessions"] == 3
    finally:
        dealer.close()


def test_session_caps_are_validated() -> None:
    with pytest.raises(Exception, match="max_sessions"):
        PeerServer(MemoryStore(), max_sessions=0, use_env_secret=False)


# --- protocol deviations -------------------------------------------------------------------


def test_replies_are_signed_only_for_authentic_requests(serve: Callable[..., PeerServer]) -> None:
    server = serve(MemoryStore(), secret="right")
    codec = P.Codec(b"right")
    # cannot be decoded: no tag on the reply
    frames = raw_request(server.endpoint, [b"\xc1garbage", b"t" * P.TAG_BYTES])
    assert frames is not None and frames[1] == b"" and reply_of(frames)["error"] == P.MALFORMED
    # decodes, but the tag is wrong: no tag
    forged = msgpack.packb({"v": 1, "id": 3, "op": "stats", "s": b"s" * 16})
    frames = raw_request(server.endpoint, [forged, b"t" * P.TAG_BYTES])
    assert frames is not None and frames[1] == b"" and reply_of(frames)["error"] == P.AUTH_FAILED
    # too large to decode: no tag
    huge = msgpack.packb({"v": 1, "id": 4, "op": "stats", "s": b"s" * (2 << 20)})
    frames = raw_request(server.endpoint, [huge, b"t" * P.TAG_BYTES])
    assert frames is not None and frames[1] == b"" and reply_of(frames)["error"] == P.TOO_LARGE
    # authentic but refused: the reply is signed and verifies
    request = codec.encode({"v": 1, "id": 5, "op": "stats", "s": b"s" * 16}, reply=False)
    frames = raw_request(server.endpoint, request)
    assert frames is not None
    body, _, authentic = codec.decode(frames, reply=True)
    assert authentic and body["error"] == P.NO_SESSION and body["id"] == 5


def test_boolean_id_is_not_an_integer(serve: Callable[..., PeerServer]) -> None:
    with pytest.raises(Exception) as exc:
        P.validate_request({"v": 1, "id": True, "op": "stats", "s": b"s" * 16})
    assert getattr(exc.value, "code", None) == P.MALFORMED
    server = serve(MemoryStore())
    reply = reply_of(
        raw_request(
            server.endpoint, [msgpack.packb({"v": 1, "id": True, "op": "stats", "s": b"s"}), b""]
        )
    )
    assert reply["error"] == P.MALFORMED and reply["id"] == 0 and reply["id"] is not False


def test_garbage_nixl_metadata_is_not_offered_nixl(serve: Callable[..., PeerServer]) -> None:
    from tests.peer.conftest import require_nixl

    require_nixl()
    from chunkstore.peer._nixlplane import NixlEndpoint

    server = serve(MemoryStore())
    assert P.PLANE_NIXL in server.planes
    dealer = Dealer(server.endpoint)
    try:
        planes = [P.PLANE_NIXL, P.PLANE_INLINE]
        garbage = dealer.ask(hello_body(planes=planes, nixl_md=b"\x00garbage metadata"))
        assert garbage["ok"] is True and garbage["planes"] == [P.PLANE_INLINE]
        assert "metadata" in garbage["nixl_reason"] and "nixl_md" not in garbage
        endpoint = NixlEndpoint("hostile-test")
        try:
            good = dealer.ask(hello_body(planes=planes, nixl_md=endpoint.metadata()))
        finally:
            endpoint.close()
        assert good["planes"] == planes and good["nixl_md"]
        # no metadata at all: nixl stays offered for fetches (the client READs from us)
        assert dealer.ask(hello_body(planes=planes))["planes"] == planes
    finally:
        dealer.close()


def test_eviction_spares_sessions_holding_leases(serve: Callable[..., PeerServer]) -> None:
    from tests.peer.conftest import require_nixl
    from tests.peer.doubles import RegisteredHostCache

    require_nixl()
    cache = RegisteredHostCache(len(CHUNKS[0].data), num_slots=8, pin_memory=False)
    cache.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    server = serve(cache, max_sessions_per_client=2, name=unique("leases"))
    leaseholder = PeerClient(
        server.endpoint,
        plane="nixl",
        client_name="same",
        recv_arena_bytes=4 << 20,
        use_env_secret=False,
    )
    dealer = Dealer(server.endpoint)
    try:
        reply, _ = leaseholder.request(
            "fetch", {"keys": P.pack_keys(KEYS[:2]), "plane": "nixl", "lease_ms": 30_000}
        )
        assert server.stats()["pins"] == 2
        for i in range(3):  # the same identity says hello again and again
            assert dealer.ask(hello_body(id=i + 1, client="same"))["ok"] is True
        stats = server.stats()
        assert stats["counts"]["sessions_evicted_per_client"] == 2
        assert stats["pins"] == 2 and cache.stats().pinned_slots == 2  # the lease survived
        leaseholder.request("release", {"lease": reply["lease"], "ack": True})
        assert cache.stats().pinned_slots == 0
    finally:
        dealer.close()
        leaseholder.close()
