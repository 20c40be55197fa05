"""A node service that stops reading (a stalled I/O thread): the engine's send queue fills.

spec/PROTOCOL.md §7: a client of the ``shm`` plane keeps its connection when the node
does not answer, since closing it ends the session and every lease the engine still
uses. A full send queue is the same case: the client keeps its connection and session,
counts the node down, and keeps the releases it could not send (a bounded number) for
the next request; past that bound it ends its session on purpose, saying so.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import chunkstore.peer._client as peer_client
from chunkstore.node import NodeClient, NodeRead, NodeStore
from chunkstore.peer import PeerMetrics
from chunkstore.testing.factories import sample_chunks
from tests.node.conftest import PATIENCE_S, SLOT_SIZE, Node, wait_until

MAX_SENDS = 200_000
"""More releases than any send queue holds (ZeroMQ's 1000 messages each side, plus the
kernel's socket buffer)."""


class Freezer:
    """Stops the service's I/O thread (it reads no message) between :meth:`freeze` and
    :meth:`thaw`."""

    def __init__(self, node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
        self._wanted = threading.Event()
        self._frozen = threading.Event()
        self._thawed = threading.Event()
        real = node.server._turn

        def turn(*args: Any) -> None:
            if self._wanted.is_set() and not self._thawed.is_set():
                self._frozen.set()
                self._thawed.wait(PATIENCE_S)
            real(*args)

        monkeypatch.setattr(node.server, "_turn", turn)

    def freeze(self) -> None:
        """Stop the I/O thread; returns once it is stopped."""
        self._wanted.set()
        assert self._frozen.wait(PATIENCE_S)

    def thaw(self) -> None:
        self._thawed.set()


@pytest.fixture
def freezer(node: Node, monkeypatch: pytest.MonkeyPatch) -> Iterator[Freezer]:
    held = Freezer(node, monkeypatch)
    try:
        yield held
    finally:
        held.thaw()  # never leave the service's thread waiting


def _failures(metrics: PeerMetrics) -> float:
    return sum(
        sample.value
        for family in metrics.registry.collect()
        if family.name == "chunkstore_peer_client_failures"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def _fill_send_queue(client: NodeClient, metrics: PeerMetrics) -> None:
    """Release leases the service never granted until a release finds no room."""
    for _ in range(MAX_SENDS):
        client.release(NodeRead(os.urandom(16), [], [], None))
        if _failures(metrics):
            return
    pytest.fail("the send queue never filled")


def _stored_and_held(node: Node, seed: int) -> tuple[NodeClient, PeerMetrics, NodeRead]:
    """A chunk in the node, and an engine holding a read lease on it (a load in flight)."""
    [chunk] = sample_chunks(1, seed=seed)
    writer = NodeStore(NodeClient(node.socket, slot_size=SLOT_SIZE, client_name="w"))
    assert writer.put_many([(chunk.key, chunk.data)]) == [True]
    writer.close()
    metrics = PeerMetrics(CollectorRegistry())
    engine = NodeClient(
        node.socket,
        slot_size=SLOT_SIZE,
        client_name="engine",
        timeout_s=0.2,
        retry_after_s=0.0,
        metrics=metrics,
    )
    read = engine.acquire([chunk.key])
    assert read.views[0] is not None and node.host.pool.pinned_slots() == 1
    return engine, metrics, read


def test_a_service_that_stops_reading_keeps_the_engine_s_session(
    node: Node, freezer: Freezer
) -> None:
    engine, metrics, read = _stored_and_held(node, seed=21)
    freezer.freeze()
    _fill_send_queue(engine, metrics)
    assert engine.attached  # connection and session kept: the load's pin lives on
    engine.release(read)  # no room: kept for later, not lost
    freezer.thaw()
    key = sample_chunks(1, seed=21)[0].key
    wait_until(lambda: engine.lookup([key]) == 1, "the service to answer again")
    wait_until(lambda: node.host.pool.pinned_slots() == 0, "the kept release to arrive")
    stats = node.server.stats()
    assert stats["sessions"] == 1 and "connections_closed" not in stats["counts"]  # never ended
    engine.close()


def test_past_its_bound_of_unsent_releases_the_engine_ends_its_session_saying_so(
    node: Node, freezer: Freezer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(peer_client, "MAX_UNSENT_RELEASES", 2)
    engine, metrics, read = _stored_and_held(node, seed=22)
    freezer.freeze()
    _fill_send_queue(engine, metrics)  # one unsent release kept
    engine.release(NodeRead(os.urandom(16), [], [], None))  # two
    assert engine.attached
    with caplog.at_level(logging.WARNING, logger="chunkstore.peer._client"):
        engine.release(read)  # three: past the bound
    assert not engine.attached
    assert any("ending its session" in r.getMessage() for r in caplog.records)
    freezer.thaw()
    # The service ends the session with the connection: every pin goes, the held one too.
    wait_until(lambda: node.host.pool.pinned_slots() == 0, "the session's pins to go")
    key = sample_chunks(1, seed=22)[0].key
    wait_until(lambda: engine.lookup([key]) == 1, "the engine to attach again")
    engine.close()


def test_a_late_lease_past_the_bound_fails_the_request_waiting_for_its_reply(
    node: Node, freezer: Freezer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request is sent (the service read a little), then, while it waits, a late reply
    grants a lease whose release finds no room, one past the bound: the session ends on
    purpose, and the waiting request fails like any unanswered one (the engine sees a miss,
    never an exception from a socket that was just closed), then attaches again."""
    engine, metrics, read = _stored_and_held(node, seed=23)
    engine.release(read)
    wait_until(lambda: node.host.pool.pinned_slots() == 0, "the held read's release")
    key = sample_chunks(1, seed=23)[0].key
    freezer.freeze()
    assert engine.acquire([key]).views == [None]  # times out: answered late, with a lease
    freezer.thaw()
    wait_until(lambda: node.host.pool.pinned_slots() == 1, "the late fetch to pin its chunk")
    # From here the send queue has room for the next request but none for a release, as
    # when the service reads one message between the two sends and no more.
    monkeypatch.setattr(peer_client, "MAX_UNSENT_RELEASES", 0)
    monkeypatch.setattr(peer_client.PeerClient, "_send_release", lambda self, lease: False)
    assert engine.lookup([key]) == 0
    assert not engine.attached
    monkeypatch.undo()
    wait_until(lambda: node.host.pool.pinned_slots() == 0, "the session's pins to go")
    wait_until(lambda: engine.lookup([key]) == 1, "the engine to attach again")
    engine.close()
