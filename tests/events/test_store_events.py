"""A shared store's announcer and query socket, alone and inside ``chunkstore serve``."""

from __future__ import annotations

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
    """Apply batches (caught up first) until ``until()`` holds or ``ROUNDS`` reads passed."""
    for received in sub.catch_up():
        index.apply("store", received)
    for _ in range(ROUNDS):
        if until():
            return
        for received in sub.receive(timeout=0.1):
            index.apply("store", received)


def prefix(index, digests):
    found = index.longest_prefix(digests)
    return found[0][0] if found else 0


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
    stop = threading.Event()
    thread = threading.Thread(target=serve.run, args=(args,), kwargs={"stop_event": stop})
    thread.start()
    try:
        index = PrefixIndex()
        with EventSubscriber(events, replay_endpoint=replay) as sub:
            for _ in range(ROUNDS):
                drain(sub, index, lambda: prefix(index, DIGESTS) == 4)
                if prefix(index, DIGESTS) == 4:
                    break
        assert index.longest_prefix(DIGESTS) == [(4, "store", "STORAGE")]
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()


def test_serve_refuses_event_options_without_events():
    args = build_parser().parse_args(
        ["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", "--events-query", "ipc://x"]
    )
    with pytest.raises(Exception, match="need --events"):
        serve.check_options(args)
