"""A node request that times out: the engine's other pins and reservations live on.

The service ends a node session, releasing its pins and aborting its reservations,
when the connection closes; so a client whose request merely timed out keeps its
connection (it only counts the service down for a while). Each test holds the
service's ``exists`` (the call a slow ``--store`` tier makes slow) behind a gate
until the client has given up on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from chunkstore.cache._pool import WRITING
from chunkstore.hashing import ChunkKey
from chunkstore.node import NodeClient, NodeStore
from chunkstore.testing.factories import sample_chunks
from tests.node.conftest import PATIENCE_S, SLOT_SIZE, Node, states, wait_until

TIMEOUT_S = 0.2
"""The clients' request timeout: the gated ``exists`` always outlasts it."""


class Gate:
    """Holds the service's ``exists_many`` until :meth:`open`; counts the calls answered."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.answered = 0
        self._lock = threading.Lock()

    def open(self) -> None:
        self.opened.set()

    def passed(self) -> None:
        with self._lock:
            self.answered += 1


@pytest.fixture
def gate(node: Node, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate()
    real = node.store.exists_many

    def gated(keys: Sequence[ChunkKey]) -> list[bool]:
        held.opened.wait(PATIENCE_S)
        try:
            return real(keys)
        finally:
            held.passed()

    monkeypatch.setattr(node.store, "exists_many", gated)
    try:
        yield held
    finally:
        held.open()  # never leave a service thread waiting


def client(node: Node, name: str, *, retry_after_s: float = 0.0) -> NodeClient:
    return NodeClient(
        node.socket,
        slot_size=SLOT_SIZE,
        client_name=name,
        timeout_s=TIMEOUT_S,
        retry_after_s=retry_after_s,
    )


def time_out_one_request(engine: NodeClient, gate: Gate) -> None:
    """One ``exists`` of ``engine`` times out; then the service answers it after all."""
    assert engine.exists([sample_chunks(1, seed=99)[0].key]) == [False]
    gate.open()
    wait_until(lambda: gate.answered >= 1, "the service to answer the late exists")


def test_a_timed_out_request_keeps_the_pins_of_reads_still_in_use(node: Node, gate: Gate) -> None:
    pool = node.host.pool
    [chunk] = sample_chunks(1, seed=1)
    writer = NodeStore(NodeClient(node.socket, slot_size=SLOT_SIZE, client_name="w"))
    gate.open()
    assert writer.put_many([(chunk.key, chunk.data)]) == [True]
    gate.opened.clear()

    reader = client(node, "r")
    read = reader.acquire([chunk.key])  # an async load whose device copy is in flight
    slot = read.slots[0]
    assert slot is not None and bytes(read.views[0] or b"") == chunk.data
    time_out_one_request(reader, gate)

    # The service still pins the slot for the reader: neither a delete nor a stream of
    # other chunks can reuse it under the copy.
    assert pool.pins(slot[0]) >= 1
    writer.delete(chunk.key)
    others = sample_chunks(16, seed=3)
    writer.put_many([(c.key, c.data) for c in others])
    assert bytes(read.views[0] or b"") == chunk.data
    assert reader.still_valid(read, 0)

    reader.release(read)
    wait_until(lambda: pool.pins(slot[0]) == 0, "the reader's pin to go once released")
    reader.close()
    writer.close()


def test_a_timed_out_request_keeps_a_reservation_so_a_late_write_corrupts_nothing(
    node: Node, gate: Gate
) -> None:
    a = client(node, "A")
    [mine] = sample_chunks(1, seed=11)
    gate.open()
    reservation = a.reserve([mine.key])
    gate.opened.clear()
    stale = reservation.views[0]
    assert stale is not None
    time_out_one_request(a, gate)
    assert states(node, WRITING) == 1  # A's reservation lives on

    b = NodeStore(NodeClient(node.socket, slot_size=SLOT_SIZE, client_name="B"))
    theirs = sample_chunks(16, seed=13)
    b.put_many([(c.key, c.data) for c in theirs])
    stale[: len(mine.data)] = mine.data  # A's device -> host copy finishes
    assert a.commit(reservation, [len(mine.data)]) == [True]
    got = b.get_many([c.key for c in theirs])
    assert all(g is None or g == c.data for g, c in zip(got, theirs))
    assert b.get_many([mine.key]) == [mine.data]
    a.close()
    b.close()


def test_a_late_reply_granting_a_reservation_is_given_back(node: Node, gate: Gate) -> None:
    engine = client(node, "late")
    [chunk] = sample_chunks(1, seed=21)
    # reserve(if_absent) asks the gated exists first: it times out, the service reserves later
    assert engine.reserve([chunk.key]).views == [None]
    gate.open()
    wait_until(lambda: gate.answered >= 1, "the service to answer the late reserve")
    wait_until(lambda: states(node, WRITING) == 1, "the late reservation")
    assert engine.exists([chunk.key]) == [False]  # its exchange reads the late reply
    wait_until(lambda: states(node, WRITING) == 0, "the late reservation to be given back")
    assert node.host.pool.pinned_slots() == 0
    engine.close()


def test_while_marked_down_requests_are_misses_and_leases_still_go_back(
    node: Node, gate: Gate
) -> None:
    pool = node.host.pool
    [chunk, unsaved] = sample_chunks(2, seed=31)
    gate.open()
    assert NodeStore(client(node, "w")).put_many([(chunk.key, chunk.data)]) == [True]
    gate.opened.clear()
    engine = client(node, "down", retry_after_s=3600.0)
    gate.open()
    read = engine.acquire([chunk.key])
    reservation = engine.reserve([unsaved.key])
    gate.opened.clear()
    slot = read.slots[0]
    assert slot is not None and reservation.views[0] is not None
    time_out_one_request(engine, gate)

    # Marked down: a miss at once, although the node holds the chunk.
    assert engine.exists([chunk.key]) == [False]
    assert engine.acquire([chunk.key]).views == [None]
    # A release is still delivered, and a commit that cannot be sent gives its slot back.
    engine.release(read)
    wait_until(lambda: pool.pins(slot[0]) == 0, "the read's pin to go")
    assert engine.commit(reservation, [len(unsaved.data)]) == [False]
    wait_until(lambda: states(node, WRITING) == 0, "the reservation to be aborted")
    assert pool.pinned_slots() == 0
    engine.close()
