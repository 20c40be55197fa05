"""The node service's KV events: what its host cache stores and drops, for routers."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.cli.commands import serve
from chunkstore.cli.main import build_parser
from chunkstore.events import (
    NODE_OWNERSHIP,
    CacheAnnouncer,
    EventBatch,
    EventPublisher,
    EventSubscriber,
    PrefixIndex,
    Received,
)
from chunkstore.node import NodeClient, NodeServer, NodeStore
from chunkstore.peer._localsocket import answers
from chunkstore.testing.factories import sample_chunks
from chunkstore.tiering import TieredStore
from tests.node.conftest import SLOT_SIZE, wait_until

ROUNDS = 100
"""Most reads of 0.1 s a test waits for batches (bounded, never a timing check)."""
CHUNKS = sample_chunks(6, seed=11)
DIGESTS = [c.key.digest for c in CHUNKS]


class Listener:
    """A router's view: every batch in order, and the index built from them."""

    def __init__(self, events: str, replay: str) -> None:
        self.sub = EventSubscriber(events, replay_endpoint=replay)
        self.index = PrefixIndex()
        self.got: list[Received] = []

    def drain(self, until: Callable[[], bool]) -> None:
        """Apply batches (caught up first) until ``until()`` holds or ``ROUNDS`` reads passed."""
        for i in range(ROUNDS):
            # A router asks the replay socket now and then: a batch published before its
            # subscription was connected (or re-connected) is seen by no later batch.
            batches = self.sub.catch_up() if i % 10 == 0 else []
            for received in batches + self.sub.receive(timeout=0.1):
                self._apply(received)
            if until():
                return

    def _apply(self, received: Received) -> None:
        self.got.append(received)
        self.index.apply("node", received)

    def events(self, kind: str) -> list[dict]:
        return [e for r in self.got for e in r.batch.events if e["type"] == kind]

    def prefix(self) -> int:
        found = self.index.longest_prefix(DIGESTS)
        return found[0][0] if found else 0

    def held(self) -> int:
        return self.index.count("node", "CPU")

    def close(self) -> None:
        self.sub.close()


class EventNode:
    """An in-process node service over a small shared pool, announcing on ``events``."""

    def __init__(self, tmp_path: Path, slots: int) -> None:
        from prometheus_client import CollectorRegistry

        from chunkstore.metrics import ChunkstoreMetrics

        self.events, self.replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
        host = HostCache(
            SLOT_SIZE,
            num_slots=slots,
            shm_name=f"cs-test-ev-{os.getpid()}-{tmp_path.name}",
            pin_memory=False,
        )
        self.tier = MemoryStore()
        self.store = TieredStore(host, [self.tier], metrics=ChunkstoreMetrics(CollectorRegistry()))
        self.publisher = EventPublisher(self.events, replay_endpoint=self.replay)
        self.announcer = CacheAnnouncer(host, self.publisher, interval=0.02).start()
        self.socket = str(tmp_path / "node.sock")
        self.server = NodeServer(
            self.store,
            bind=f"ipc://{self.socket}",
            planes=("shm",),
            name="node",
            use_env_secret=False,
        ).start()
        self.engine = NodeStore(NodeClient(self.socket, slot_size=SLOT_SIZE))

    def close(self) -> None:
        self.engine.close()
        self.server.stop()
        self.announcer.close()
        self.publisher.close()
        self.store.close()


@pytest.fixture
def small_node(tmp_path: Path) -> Iterator[EventNode]:
    node = EventNode(tmp_path, slots=4)
    try:
        yield node
    finally:
        node.close()


@pytest.fixture
def listener(small_node: EventNode) -> Iterator[Listener]:
    got = Listener(small_node.events, small_node.replay)
    try:
        yield got
    finally:
        got.close()


def put(node: EventNode, chunks: list) -> None:
    assert node.engine.put_many([(c.key, c.data) for c in chunks]) == [True] * len(chunks)


def test_an_engines_stores_are_announced_with_keys_parents_tokens_namespace(
    small_node: EventNode, listener: Listener
) -> None:
    put(small_node, CHUNKS[:3])
    listener.drain(lambda: listener.prefix() == 3)
    assert listener.index.longest_prefix(DIGESTS) == [(3, "node", "CPU")]
    assert listener.got[0].batch.events[0] == {"type": "AllBlocksCleared"}
    stored = {e["block_hashes"][0]: e for e in listener.events("BlockStored")}
    for chunk in CHUNKS[:3]:
        event = stored[chunk.key.digest]
        assert event["parent_block_hash"] == chunk.parent
        assert event["token_ids"] == [int(t) for t in chunk.tokens]
        assert event["block_size"] == len(chunk.tokens)
        assert event["extra_keys"] == [("namespace", chunk.key.namespace)]
        assert (event["medium"], event["locality"]) == ("CPU", "LOCAL")
        assert event["ownership"] == NODE_OWNERSHIP
    assert CHUNKS[1].parent == CHUNKS[0].key.digest  # they chain as announced


def test_evictions_and_deletes_are_announced_as_removals(
    small_node: EventNode, listener: Listener
) -> None:
    put(small_node, CHUNKS[:4])
    listener.drain(lambda: listener.held() == 4)
    assert listener.held() == 4
    put(small_node, CHUNKS[4:6])  # a pool of 4 slots: two chunks are evicted
    listener.drain(lambda: len(listener.events("BlockRemoved")) >= 2 and listener.held() == 4)
    removed = {e["block_hashes"][0] for e in listener.events("BlockRemoved")}
    held = {c.key.digest for c in CHUNKS if small_node.store.host.exists(c.key)}
    assert len(removed) == 2 and removed.isdisjoint(held) and len(held) == 4
    assert all(e["medium"] == "CPU" for e in listener.events("BlockRemoved"))
    assert small_node.engine.delete_many([CHUNKS[5].key]) == 1
    listener.drain(lambda: listener.held() == 3)
    assert listener.held() == 3
    assert listener.index.longest_prefix([CHUNKS[5].key.digest]) == []
    assert listener.sub.lost == 0


def test_a_chunk_promoted_from_a_tier_is_announced(
    small_node: EventNode, listener: Listener
) -> None:
    chunk = CHUNKS[0]
    small_node.tier.put_many([(chunk.key, chunk.data)])
    listener.drain(lambda: bool(listener.got))
    assert listener.held() == 0  # a tier's chunk is not the host cache's
    assert small_node.engine.get(chunk.key) == chunk.data  # the node promotes it
    listener.drain(lambda: listener.held() == 1)
    assert listener.index.longest_prefix(DIGESTS) == [(1, "node", "CPU")]


def test_a_dropped_subscriber_catches_up_through_replay_without_a_gap(
    small_node: EventNode, listener: Listener
) -> None:
    put(small_node, CHUNKS[:1])
    listener.drain(lambda: listener.held() == 1)
    # Batches queued for the subscriber are lost when its socket goes (a router dropping
    # its connection); sequence numbers tell it what to ask the replay socket for.
    for chunk in CHUNKS[1:3]:
        put(small_node, [chunk])
        small_node.announcer.pump()
    small_node.publisher.flush()
    listener.sub.connect()
    put(small_node, CHUNKS[3:4])
    listener.drain(lambda: listener.prefix() == 4)
    assert listener.prefix() == 4
    seqs = [r.seq for r in listener.got]
    assert seqs == list(range(len(seqs)))
    assert listener.sub.lost == 0 and listener.sub.replayed > 0


def test_vllm_decodes_what_the_node_publishes(small_node: EventNode, listener: Listener) -> None:
    pytest.importorskip("vllm")
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

    put(small_node, CHUNKS[:2])
    listener.drain(lambda: listener.held() == 2)
    decoded = [msgspec.msgpack.decode(r.payload, type=KVEventBatch) for r in listener.got]
    assert isinstance(decoded[0].events[0], AllBlocksCleared)
    stored = [e for batch in decoded for e in batch.events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[d] for d in DIGESTS[:2]]
    assert stored[1].parent_block_hash == DIGESTS[0]
    assert {(e.medium, e.locality, e.ownership) for e in stored} == {("CPU", "LOCAL", "node")}
    assert stored[0].extra_keys == [("namespace", CHUNKS[0].key.namespace)]
    assert {e.group_idx for e in stored} == {None}  # a chunk holds every KV cache group


def test_a_start_announces_what_the_cache_holds_already(tmp_path: Path) -> None:
    host = HostCache(SLOT_SIZE, num_slots=4, pin_memory=False)
    host.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    ends = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as publisher:
        announcer = CacheAnnouncer(host, publisher).start()
        got = Listener(*ends)
        try:
            got.drain(lambda: got.prefix() == 2)
            assert got.prefix() == 2
            assert announcer.held == 2
        finally:
            announcer.close()
            got.close()
    assert host.listener is None  # closing stops listening
    host.close()


def test_the_announcer_copies_chunk_headers_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chunkstore.format import header_bytes_needed

    host = HostCache(SLOT_SIZE, num_slots=4, pin_memory=False)
    host.put_many([(c.key, c.data) for c in CHUNKS[:2]])
    copied: list[int] = []
    headers = host.read_headers_unchecked_many

    def counted(keys: list) -> list:
        got = headers(keys)
        copied.extend(len(data) for data in got if data is not None)
        return got

    def whole(keys: list) -> list:
        raise AssertionError("the announcer read a whole chunk")

    monkeypatch.setattr(host, "read_headers_unchecked_many", counted)
    monkeypatch.setattr(host, "read_unchecked_many", whole)
    ends = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as publisher:
        announcer = CacheAnnouncer(host, publisher).start()  # the listing
        got = Listener(*ends)
        try:
            host.put_many([(c.key, c.data) for c in CHUNKS[2:4]])  # the changes
            got.drain(lambda: got.prefix() == 4)
            assert got.prefix() == 4
        finally:
            announcer.close()
            got.close()
    host.close()
    heads = [header_bytes_needed(c.data[:8]) for c in CHUNKS[:4]]
    assert copied == heads and all(h < len(c.data) for h, c in zip(heads, CHUNKS))
    stored = got.events("BlockStored")
    assert [e["block_hashes"] for e in stored] == [[c.key.digest] for c in CHUNKS[:4]]
    assert [e["token_ids"] for e in stored] == [[int(t) for t in c.tokens] for c in CHUNKS[:4]]
    assert [e["parent_block_hash"] for e in stored] == [c.parent for c in CHUNKS[:4]]


def test_the_announcer_publishes_in_pages(tmp_path: Path) -> None:
    host = HostCache(SLOT_SIZE, num_slots=6, pin_memory=False)
    host.put_many([(c.key, c.data) for c in CHUNKS[:5]])
    ends = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    with EventPublisher(ends[0], replay_endpoint=ends[1]) as publisher:
        sizes: list[list[str]] = []
        publish = publisher.publish

        def noted(batch: EventBatch) -> None:
            sizes.append([e["type"] for e in batch.events])
            publish(batch)

        publisher.publish = noted  # type: ignore[method-assign]
        announcer = CacheAnnouncer(host, publisher, interval=3600, page=2).start()
        try:
            assert announcer.held == 5
            stored = ["BlockStored"]
            assert sizes == [["AllBlocksCleared"], stored * 2, stored * 2, stored]
            sizes.clear()
            host.delete_many([c.key for c in CHUNKS[:3]])
            host.put(CHUNKS[5].key, CHUNKS[5].data)
            assert announcer.pump() == (1, 3)
            assert [len(page) for page in sizes] == [2, 2]
            assert sorted(t for page in sizes for t in page) == ["BlockRemoved"] * 3 + stored
            assert announcer.pump() == (0, 0) and len(sizes) == 2  # nothing: no empty batch
        finally:
            announcer.close()
    host.close()


def _serve(tmp_path: Path, events: str, replay: str) -> tuple[threading.Event, threading.Thread]:
    socket = tmp_path / "node.sock"
    args = build_parser().parse_args(
        [
            "serve",
            "--slot-size",
            str(SLOT_SIZE),
            "--host-cache",
            str(4 * SLOT_SIZE),
            "--node",
            str(socket),
            "--node-events",
            events,
            "--node-events-replay",
            replay,
        ]
    )
    stop = threading.Event()
    thread = threading.Thread(target=serve.run, args=(args,), kwargs={"stop_event": stop})
    thread.start()
    wait_until(lambda: answers(socket) or not thread.is_alive(), "the node service to start")
    assert thread.is_alive()
    return stop, thread


def _stop(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    thread.join(30)
    assert not thread.is_alive()


def test_serve_node_events_and_a_restart_the_router_converges_on(tmp_path: Path) -> None:
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    socket = str(tmp_path / "node.sock")
    got = Listener(events, replay)
    try:
        stop, thread = _serve(tmp_path, events, replay)
        try:
            engine = NodeStore(NodeClient(socket, slot_size=SLOT_SIZE))
            try:
                assert engine.put_many([(c.key, c.data) for c in CHUNKS[:3]]) == [True] * 3
            finally:
                engine.close()
            got.drain(lambda: got.prefix() == 3)
            assert got.index.longest_prefix(DIGESTS) == [(3, "node", "CPU")]
        finally:
            _stop(stop, thread)
        got.drain(lambda: got.held() == 0)  # a stopping service clears what it said
        assert got.held() == 0
        # A restarted service starts empty and says so; the router forgets, then learns anew.
        cleared = len(got.events("AllBlocksCleared"))
        stop, thread = _serve(tmp_path, events, replay)
        try:
            engine = NodeStore(NodeClient(socket, slot_size=SLOT_SIZE))
            try:
                assert engine.put_many([(CHUNKS[0].key, CHUNKS[0].data)]) == [True]
            finally:
                engine.close()
            got.drain(lambda: got.held() == 1)
            assert got.index.longest_prefix(DIGESTS) == [(1, "node", "CPU")]
            # Seen as a new publisher: by its AllBlocksCleared, or by its sequence restarting.
            assert len(got.events("AllBlocksCleared")) > cleared or got.sub.restarts >= 1
            assert got.sub.restarts >= 1
        finally:
            _stop(stop, thread)
    finally:
        got.close()


def test_a_router_that_missed_the_stop_converges_on_the_restart(tmp_path: Path) -> None:
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    socket = str(tmp_path / "node.sock")
    index = PrefixIndex()
    stop, thread = _serve(tmp_path, events, replay)
    try:
        got = Listener(events, replay)
        try:
            engine = NodeStore(NodeClient(socket, slot_size=SLOT_SIZE))
            try:
                assert engine.put_many([(c.key, c.data) for c in CHUNKS[:2]]) == [True] * 2
            finally:
                engine.close()
            got.drain(lambda: got.prefix() == 2)
            for received in got.got:
                index.apply("node", received)
        finally:
            got.close()
    finally:
        _stop(stop, thread)
    assert index.count("node", "CPU") == 2  # this router never heard the stop
    stop, thread = _serve(tmp_path, events, replay)
    try:
        with EventSubscriber(events, replay_endpoint=replay) as sub:
            for received in sub.catch_up():
                index.apply("node", received)
        assert index.count("node", "CPU") == 0  # AllBlocksCleared, first of the new service
    finally:
        _stop(stop, thread)
