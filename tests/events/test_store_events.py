"""A shared store's announcer and query socket, alone and inside ``chunkstore serve``."""

from __future__ import annotations

import contextlib
import struct
import threading

import pytest

pytest.importorskip("zmq")

import msgpack  # noqa: E402
import zmq  # noqa: E402

from chunkstore.backends import MemoryStore, open_store  # noqa: E402
from chunkstore.cli.commands import serve  # noqa: E402
from chunkstore.cli.main import build_parser  # noqa: E402
from chunkstore.cli.storeaccess import read_header_of  # noqa: E402
from chunkstore.events import (  # noqa: E402
    ChunkQuery,
    EventPublisher,
    EventSubscriber,
    PrefixIndex,
    StoreAnnouncer,
)
from chunkstore.testing.factories import sample_chunks  # noqa: E402
from tests.services import free_port  # noqa: E402

ROUNDS = 100
"""Most reads of 0.1 s a test waits for batches (bounded, never a timing check)."""
CHUNKS = sample_chunks(4, seed=3)
DIGESTS = [c.key.digest for c in CHUNKS]


def describe(store):
    def read(key):
        header = read_header_of(store, key)
        return None if header is None else (header.parent, list(header.tokens))

    return read


def drain(sub, index, until):
    """Apply batches until ``until()`` holds or ``ROUNDS`` reads passed, catching up first
    and every tenth read: what PUB sent before the subscriber joined comes by replay."""
    for n in range(ROUNDS):
        if n % 10 == 0:
            for received in sub.catch_up():
                index.apply("store", received)
        if until():
            return
        for received in sub.receive(timeout=0.1):
            index.apply("store", received)


def prefix(index, digests):
    found = index.longest_prefix(digests)
    return found[0][0] if found else 0


@contextlib.contextmanager
def serving(args):
    """``chunkstore serve`` with ``args`` on a thread, stopped (and seen to stop) on exit."""
    stop = threading.Event()
    thread = threading.Thread(target=serve.run, args=(args,), kwargs={"stop_event": stop})
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


@pytest.fixture
def ends(tmp_path):
    return f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"


def test_listing_deltas_become_stores_and_removals(ends):
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        announcer = StoreAnnouncer([store], pub, describe(store), page=1)
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            index = PrefixIndex()
            assert announcer.scan() == (2, 0)
            pub.flush()
            drain(sub, index, lambda: prefix(index, DIGESTS) == 2)
            assert prefix(index, DIGESTS) == 2
            store.put_many([(c.key, c.data) for c in CHUNKS[2:]])
            assert announcer.scan() == (2, 0)
            pub.flush()
            drain(sub, index, lambda: prefix(index, DIGESTS) == 4)
            assert index.longest_prefix(DIGESTS) == [(4, "store", "STORAGE")]
            store.delete_many([CHUNKS[1].key])
            assert announcer.scan() == (0, 1)
            pub.flush()
            drain(sub, index, lambda: prefix(index, DIGESTS) == 1)
            assert prefix(index, DIGESTS) == 1 and index.count("store", "STORAGE") == 3
            assert sub.lost == 0


def test_events_carry_keys_parents_tokens_and_the_namespace(ends):
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        StoreAnnouncer([store], pub, describe(store)).scan()
        pub.flush()
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            events = [e for r in sub.catch_up() for e in r.batch.events]
    assert events[0] == {"type": "AllBlocksCleared"}
    stored = {e["block_hashes"][0]: e for e in events[1:]}
    assert set(stored) == set(DIGESTS)
    for c in CHUNKS:
        e = stored[c.key.digest]
        assert e["parent_block_hash"] == c.parent and e["token_ids"] == c.tokens.tolist()
        assert e["block_size"] == len(c.tokens) and e["medium"] == "STORAGE"
        assert e["ownership"] == "shared" and e["extra_keys"] == [("namespace", c.key.namespace)]
        assert e.get("group_idx") is None  # a chunk holds every KV cache group


def test_vllm_decodes_the_store_announcements(ends):
    pytest.importorskip("vllm")
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        StoreAnnouncer([store], pub, describe(store)).scan()
        pub.flush()
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            batches = [msgspec.msgpack.decode(r.payload, type=KVEventBatch) for r in sub.catch_up()]
    events = [e for b in batches for e in b.events]
    assert isinstance(events[0], AllBlocksCleared)
    assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in events[1:])
    assert sorted(e.block_hashes[0] for e in events[1:]) == sorted(DIGESTS)


def test_a_restarted_announcer_is_seen_and_announces_the_store_again(ends):
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    index = PrefixIndex()
    with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            StoreAnnouncer([store], pub, describe(store)).scan()
            pub.flush()
            drain(sub, index, lambda: prefix(index, DIGESTS) == 4)
        store.delete_many([CHUNKS[2].key])  # pruned while no announcer ran
        with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
            announcer = StoreAnnouncer([store], pub, describe(store))
            for _ in range(ROUNDS):  # the announcer rescans until the subscriber hears it
                announcer._started = False
                announcer._held.clear()
                announcer.scan()
                pub.flush()
                got = sub.receive(timeout=0.1)
                for received in got:
                    index.apply("store", received)
                if got:
                    break
            drain(sub, index, lambda: index.count("store", "STORAGE") == 3)
    assert prefix(index, DIGESTS) == 2 and index.count("store", "STORAGE") == 3


def test_query_answers_which_keys_exist_and_the_leading_run(tmp_path):
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in (CHUNKS[0], CHUNKS[1], CHUNKS[3])])
    query = ChunkQuery(store, f"ipc://{tmp_path}/query")
    try:
        ns = CHUNKS[0].key.namespace
        ask = {"namespace": ns, "keys": DIGESTS}
        assert query.answer(msgpack.packb(ask)) == {
            "exists": [True, True, False, True],
            "prefix": 2,
        }
        # Another namespace names other chunks: the same digests are not there.
        other = {"namespace": "0" * 16, "keys": DIGESTS}
        assert query.answer(msgpack.packb(other))["prefix"] == 0
        for bad in (b"\xc1", msgpack.packb([1]), msgpack.packb({"namespace": "x", "keys": []})):
            assert "error" in query.answer(bad)
        assert "error" in query.answer(msgpack.packb({"namespace": ns, "keys": [b"short"]}))
        assert query.errors == 4
        ctx = zmq.Context()
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(query.endpoint)
        req.send(msgpack.packb(ask))
        assert req.poll(10_000)
        assert msgpack.unpackb(req.recv()) == {"exists": [True, True, False, True], "prefix": 2}
        req.close(0)
        ctx.term()
    finally:
        query.close()


def test_serve_publishes_what_its_store_holds(tmp_path):
    disk = open_store(str(tmp_path / "disk"), create=True)
    disk.put_many([(c.key, c.data) for c in CHUNKS])
    disk.close()
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    args = build_parser().parse_args(
        [
            "serve",
            "--slot-size",
            "1MiB",
            "--host-cache",
            "4MiB",
            "--store",
            str(tmp_path / "disk"),
            "--events",
            events,
            "--events-replay",
            replay,
            "--events-query",
            f"ipc://{tmp_path}/q",
        ]
    )
    with serving(args):
        index = PrefixIndex()
        with EventSubscriber(events, replay_endpoint=replay) as sub:
            drain(sub, index, lambda: prefix(index, DIGESTS) == 4)
        assert index.longest_prefix(DIGESTS) == [(4, "store", "STORAGE")]


def test_serve_refuses_event_options_without_events():
    args = build_parser().parse_args(
        ["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", "--events-query", "ipc://x"]
    )
    with pytest.raises(Exception, match="need --events"):
        serve.check_options(args)


def ask_socket(endpoint, request, *, server_key=None, wait_ms=10_000):
    """One request over a REQ socket, and its decoded reply (None if none came in
    ``wait_ms``). With ``server_key`` the socket is a CurveZMQ client of that server."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        req.curve_serverkey, req.curve_publickey, req.curve_secretkey = server_key, public, secret
    try:
        req.connect(endpoint)
        req.send(msgpack.packb(request))
        if not req.poll(wait_ms):
            return None
        return msgpack.unpackb(req.recv())
    finally:
        req.close(0)
        ctx.term()


def test_a_query_socket_with_a_token_answers_only_requests_that_carry_it(tmp_path):
    from chunkstore.events._announcer import QUERY_REFUSED

    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    query = ChunkQuery(store, f"ipc://{tmp_path}/query", token=b"s3cret-token")
    try:
        assert query.needs_token
        ask = {"namespace": CHUNKS[0].key.namespace, "keys": DIGESTS}
        answer = {"exists": [True, True, False, False], "prefix": 2}
        assert query.answer(msgpack.packb({**ask, "token": b"s3cret-token"})) == answer
        assert query.answer(msgpack.packb({**ask, "token": "s3cret-token"})) == answer  # str too
        for wrong in ({}, {"token": b"s3cret-tokeN"}, {"token": b"s3cret"}, {"token": 7}):
            assert query.answer(msgpack.packb({**ask, **wrong})) == {"error": QUERY_REFUSED}
        assert query.refused == 4 and query.errors == 0
        # Malformed requests are told so whatever their token: there is no map to read it in.
        assert "error" in query.answer(b"\xc1") and query.errors == 1
        # Over the socket, as a router asks.
        assert ask_socket(query.endpoint, {**ask, "token": b"s3cret-token"}) == answer
        assert ask_socket(query.endpoint, ask) == {"error": QUERY_REFUSED}
    finally:
        query.close()
    with pytest.raises(ValueError, match="1 to 1024 bytes"):
        ChunkQuery(store, f"ipc://{tmp_path}/q2", token=b"")


def test_serve_refuses_a_query_socket_open_to_the_network_without_a_token(tmp_path):
    from chunkstore.errors import ConfigError

    def check(*options):
        base = ["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", "--events", "ipc://e"]
        serve.check_options(build_parser().parse_args([*base, *options]))

    for exposed in ("tcp://*:5559", "tcp://0.0.0.0:5559", "tcp://10.1.2.3:5559", "tcp://eth0:1"):
        with pytest.raises(ConfigError, match="answers anyone who can connect"):
            check("--events-query", exposed)
    for local in ("tcp://127.0.0.1:5559", "tcp://localhost:5559", "tcp://[::1]:5559", "ipc://q"):
        check("--events-query", local)
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    check("--events-query", "tcp://*:5559", "--events-query-token-file", str(token))
    with pytest.raises(ConfigError, match="needs --events-query"):
        check("--events-query-token-file", str(token))


def test_serve_answers_queries_with_the_token_file_and_refuses_those_without(tmp_path):
    from chunkstore.cli.eventsservice import read_query_token
    from chunkstore.errors import ConfigError
    from chunkstore.events._announcer import QUERY_REFUSED

    disk = open_store(str(tmp_path / "disk"), create=True)
    disk.put_many([(c.key, c.data) for c in CHUNKS[:3]])
    disk.close()
    token = tmp_path / "token"
    token.write_text("  s3cret-token  \nignored\n")
    assert read_query_token(str(token)) == b"s3cret-token"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="holds no token"):
        read_query_token(str(empty))
    with pytest.raises(ConfigError, match="No such file"):
        read_query_token(str(tmp_path / "missing"))
    endpoint = f"ipc://{tmp_path}/q"
    args = build_parser().parse_args(
        [
            "serve",
            "--slot-size",
            "1MiB",
            "--host-cache",
            "4MiB",
            "--store",
            str(tmp_path / "disk"),
            "--events",
            f"ipc://{tmp_path}/ev",
            "--events-query",
            endpoint,
            "--events-query-token-file",
            str(token),
        ]
    )
    with serving(args):
        ask = {"namespace": CHUNKS[0].key.namespace, "keys": DIGESTS}
        assert ask_socket(endpoint, {**ask, "token": b"s3cret-token"})["prefix"] == 3
        assert ask_socket(endpoint, {**ask, "token": b"guess"}) == {"error": QUERY_REFUSED}


# --- stores followed through their capacity index's change feed ----------------------------


@pytest.fixture
def indexed(tmp_path, redis_url):
    """Two objects of one indexed store, as two nodes: the announcer's and a writer's."""
    pytest.importorskip("redis")
    from chunkstore.backends._fs import FsStore

    root = str(tmp_path / "shared")
    writer = FsStore(root, create=True, index=redis_url)
    watched = FsStore(root, index=redis_url)
    yield watched, writer
    writer.close()
    watched.close()


def test_an_indexed_store_is_followed_between_listings(ends, indexed):
    """With a listing an hour away, another writer's stores and deletes still reach the
    subscriber: through the index's change feed."""
    watched, writer = indexed
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        announcer = StoreAnnouncer([watched], pub, describe(watched), interval=3600).start()
        try:
            assert len(announcer.feeds) == 1
            with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
                index = PrefixIndex()
                for chunk in CHUNKS[:3]:
                    writer.put(chunk.key, chunk.data)
                writer.index.flush()
                drain(sub, index, lambda: prefix(index, DIGESTS) == 3)
                assert prefix(index, DIGESTS) == 3
                writer.delete_many([CHUNKS[1].key])
                drain(sub, index, lambda: prefix(index, DIGESTS) == 1)
                assert prefix(index, DIGESTS) == 1 and index.count("store", "STORAGE") == 2
                assert sub.lost == 0
            assert announcer.followed == 4
        finally:
            announcer.close()


def test_a_listing_only_announcer_does_not_follow(ends, indexed):
    watched, _ = indexed
    with EventPublisher(ends[0]) as pub:
        assert StoreAnnouncer([watched], pub, describe(watched), follow=False).feeds == []


def test_a_gap_in_the_feed_has_the_stores_listed_at_once(ends, indexed, tmp_path):
    """Chunks that never went through the feed (written with no index) are announced as
    soon as the feed says it lost entries, not at the next listing an hour away."""
    from chunkstore.backends._fs import FsStore

    watched, writer = indexed
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        announcer = StoreAnnouncer([watched], pub, describe(watched), interval=3600).start()
        try:
            with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
                index = PrefixIndex()
                writer.put(CHUNKS[0].key, CHUNKS[0].data)
                writer.index.flush()
                drain(sub, index, lambda: prefix(index, DIGESTS) == 1)
                unindexed = FsStore(str(tmp_path / "shared"))
                unindexed.put_many([(c.key, c.data) for c in CHUNKS[1:]])
                unindexed.close()
                writer.index.client.delete(announcer.feeds[0].key)  # the stream lost
                drain(sub, index, lambda: prefix(index, DIGESTS) == 4)
                assert prefix(index, DIGESTS) == 4
        finally:
            announcer.close()


def test_a_followed_store_whose_header_is_not_readable_yet_is_tried_again(ends, indexed, tmp_path):
    """Another mount may show a new file a moment after the feed names it. An entry with no
    parent and tokens (``d``), as a reconcile adds for a file it found, is described from
    the chunk's header."""
    from chunkstore.backends._fs import FsStore

    watched, _ = indexed
    seen = describe(watched)
    asked: list[object] = []

    def late(key):
        asked.append(key)
        return None if len(asked) == 1 else seen(key)

    with EventPublisher(ends[0]) as pub:
        announcer = StoreAnnouncer([watched], pub, late, interval=3600)
        announcer.scan()
        plain = FsStore(str(tmp_path / "shared"))  # no index: no entry of its own
        plain.put(CHUNKS[0].key, CHUNKS[0].data)
        plain.close()
        feed = announcer.feeds[0]
        feed.client.xadd(feed.key, {"s": CHUNKS[0].key.path})
        assert announcer.follow(0.5) == 0 and announcer.held == 0
        assert announcer.follow(0.05) == 1 and announcer.held == 1
        assert asked == [CHUNKS[0].key, CHUNKS[0].key]
        assert announcer.follow(0.05) == 0  # announced once


def test_a_writers_feed_entry_carries_what_its_chunk_is_announced_with(ends, indexed):
    """A writer's entry carries the chunk's parent and tokens: the announcer publishes them
    without reading a header, and they are the header's."""
    watched, writer = indexed

    def never(key):
        raise AssertionError(f"read the header of {key}")

    with EventPublisher(ends[0], replay_endpoint=ends[1]) as pub:
        announcer = StoreAnnouncer([watched], pub, never, interval=3600)
        announcer.scan()
        with EventSubscriber(ends[0], replay_endpoint=ends[1]) as sub:
            index, got = PrefixIndex(), []
            writer.put_many([(c.key, c.data) for c in CHUNKS])
            writer.index.flush()
            assert announcer.follow(0.5) == len(CHUNKS)
            pub.flush()
            for _ in range(ROUNDS):
                for received in sub.catch_up() + sub.receive(timeout=0.1):
                    index.apply("store", received)
                    got += [e for e in received.batch.events if e["type"] == "BlockStored"]
                if len(got) >= len(CHUNKS):
                    break
    headers = {c.key.digest: describe(watched)(c.key) for c in CHUNKS}
    assert {e["block_hashes"][0]: (e["parent_block_hash"], e["token_ids"]) for e in got} == (
        headers
    )
    assert announcer.bad_links == 0


def test_a_feed_entry_whose_tokens_do_not_hash_to_its_key_is_read_from_the_header(
    ends, indexed, tmp_path
):
    """``d`` is a writer's word: one that is not what the key hashes (or is cut short) is
    counted and the chunk's header read instead."""
    from chunkstore.backends._fs import FsStore

    watched, _ = indexed
    read: list[object] = []
    seen = describe(watched)

    def header(key):
        read.append(key)
        return seen(key)

    with EventPublisher(ends[0]) as pub:
        announcer = StoreAnnouncer([watched], pub, header, interval=3600)
        announcer.scan()
        plain = FsStore(str(tmp_path / "shared"))  # no index: no entries of its own
        plain.put_many([(c.key, c.data) for c in CHUNKS[:2]])
        plain.close()
        feed = announcer.feeds[0]
        parent, tokens = seen(CHUNKS[0].key)
        lying = parent + struct.pack(f"<{len(tokens)}I", *[t + 1 for t in tokens])
        feed.client.xadd(feed.key, {"s": CHUNKS[0].key.path, "d": lying})
        feed.client.xadd(feed.key, {"s": CHUNKS[1].key.path, "d": b"short"})
        assert announcer.follow(0.5) == 2
    assert read == [CHUNKS[0].key, CHUNKS[1].key]
    assert announcer.bad_links == 2


def test_serve_follows_a_store_opened_with_its_index(tmp_path, redis_url):
    """``--store-option index=URL`` reaches the store; its writers' chunks are then
    announced well before the next listing (an hour away)."""
    pytest.importorskip("redis")
    from chunkstore.backends._fs import FsStore

    root = tmp_path / "shared"
    writer = FsStore(str(root), create=True, index=redis_url)
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    args = build_parser().parse_args(
        ["serve", "--slot-size", "1MiB", "--host-cache", "4MiB", "--store", str(root)]
        + ["--store-option", f"index={redis_url}", "--events", events]
        + ["--events-replay", replay, "--events-interval", "3600"]
    )
    try:
        with serving(args):
            index = PrefixIndex()
            with EventSubscriber(events, replay_endpoint=replay) as sub:
                drain(sub, index, lambda: sub.expected is not None)  # the announcer is up
                writer.put_many([(c.key, c.data) for c in CHUNKS])
                writer.index.flush()
                drain(sub, index, lambda: prefix(index, DIGESTS) == 4)
            assert index.longest_prefix(DIGESTS) == [(4, "store", "STORAGE")]
    finally:
        writer.close()


def test_announcing_a_store_does_not_count_as_using_its_chunks(tmp_path, redis_url):
    """The announcer reads every chunk's header; those reads must leave the chunks' last
    uses (here, the index's LRU scores) as they were, or announcing would reorder eviction."""
    pytest.importorskip("redis")
    from chunkstore.backends._fs import FsStore

    root = tmp_path / "shared"
    writer = FsStore(str(root), create=True, index=redis_url, access_resolution=0)
    writer.put_many([(c.key, c.data) for c in CHUNKS])
    writer.index.flush()
    lru = writer.index._keys[1]
    before = writer.index.client.zrange(lru, 0, -1, withscores=True)
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    args = build_parser().parse_args(
        ["serve", "--slot-size", "1MiB", "--host-cache", "4MiB", "--store", str(root)]
        + ["--store-option", f"index={redis_url}", "--store-option", "access_resolution=0"]
        + ["--events", events, "--events-replay", replay]
    )
    with serving(args):
        index = PrefixIndex()
        with EventSubscriber(events, replay_endpoint=replay) as sub:
            drain(sub, index, lambda: prefix(index, DIGESTS) == 4)
        assert prefix(index, DIGESTS) == 4
    assert writer.index.client.zrange(lru, 0, -1, withscores=True) == before
    writer.close()


needs_curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")


@needs_curve
def test_a_curve_query_socket_answers_only_clients_that_know_its_key(tmp_path):
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    server_public, server_secret = zmq.curve_keypair()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    query = ChunkQuery(store, endpoint, token=b"tok", curve_secret=server_secret)
    try:
        assert query.curve_public == server_public
        ask = {"namespace": CHUNKS[0].key.namespace, "keys": DIGESTS, "token": b"tok"}
        answer = {"exists": [True, True, False, False], "prefix": 2}
        assert ask_socket(endpoint, ask, server_key=server_public) == answer
        # a plain client's handshake fails, and so does one that has another server's key
        assert ask_socket(endpoint, ask, wait_ms=500) is None
        assert ask_socket(endpoint, ask, server_key=zmq.curve_keypair()[0], wait_ms=500) is None
        assert ask_socket(endpoint, ask, server_key=server_public) == answer  # still serving
    finally:
        query.close()


@needs_curve
def test_serve_reads_the_curve_secret_file_and_prints_the_public_key(tmp_path, capsys):
    from chunkstore.cli.eventsservice import read_curve_secret
    from chunkstore.errors import ConfigError

    disk = open_store(str(tmp_path / "disk"), create=True)
    disk.put_many([(c.key, c.data) for c in CHUNKS[:3]])
    disk.close()
    public, secret = zmq.curve_keypair()
    keyfile = tmp_path / "curve"
    keyfile.write_bytes(secret + b"\n")
    assert read_curve_secret(str(keyfile)) == secret
    for bad, message in ((b"short\n", "40 Z85"), (b" " * 40, "40 Z85"), (b"~" * 40, "not a")):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(ConfigError, match=message):
            read_curve_secret(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match="No such file"):
        read_curve_secret(str(tmp_path / "missing"))
    endpoint = f"ipc://{tmp_path}/q"
    args = build_parser().parse_args(
        ["serve", "--slot-size", "1MiB", "--host-cache", "4MiB", "--store", str(tmp_path / "disk")]
        + ["--events", f"ipc://{tmp_path}/ev", "--events-query", endpoint]
        + ["--events-query-curve-secret-file", str(keyfile)]
    )
    with serving(args):
        ask = {"namespace": CHUNKS[0].key.namespace, "keys": DIGESTS}
        assert ask_socket(endpoint, ask, server_key=public)["prefix"] == 3
    assert f"CurveZMQ, public key {public.decode()}" in capsys.readouterr().out
    lonely = build_parser().parse_args(
        ["serve", "--slot-size", "4KiB", "--host-cache", "64KiB"]
        + ["--events-query-curve-secret-file", str(keyfile)]
    )
    with pytest.raises(ConfigError, match="needs --events-query"):
        serve.check_options(lonely)
