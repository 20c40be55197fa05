"""A reply the node service cannot send gives back what it granted.

The service sends without blocking: a reply to an engine whose queue is full (it stopped
reading) or that left is dropped. The engine then never learns the lease the reply named,
so it could never release it; and since a node session outlives a timed-out request
(spec/PROTOCOL.md §7), the pins or the reservation would stay until the engine detaches.
The service releases them when the reply is dropped. Each test makes the service's
socket refuse one reply as a full queue does (``zmq.Again``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from chunkstore.cache._pool import WRITING
from chunkstore.node import NodeClient, NodeStore
from chunkstore.testing.factories import sample_chunks
from tests.node.conftest import SLOT_SIZE, Node, states, wait_until

TIMEOUT_S = 0.3


class RefusingSocket:
    """The service's socket, refusing the next ``refuse`` replies as a full queue does."""

    def __init__(self, real: Any, owner: Refusals) -> None:
        self._real = real
        self._owner = owner

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        if self._owner.refuse > 0:
            self._owner.refuse -= 1
            self._owner.refused += 1
            raise zmq.Again()
        return self._real.send_multipart(frames, *args, **kwargs)


class Refusals:
    refuse = 0
    refused = 0


@pytest.fixture
def refusals(node: Node, monkeypatch: pytest.MonkeyPatch) -> Iterator[Refusals]:
    counts = Refusals()
    real = node.server._send_replies
    monkeypatch.setattr(
        node.server, "_send_replies", lambda router: real(RefusingSocket(router, counts))
    )
    yield counts


def engine(node: Node, name: str) -> NodeClient:
    return NodeClient(
        node.socket, slot_size=SLOT_SIZE, client_name=name, timeout_s=TIMEOUT_S, retry_after_s=0
    )


def test_a_dropped_read_reply_releases_its_pins(node: Node, refusals: Refusals) -> None:
    [chunk] = sample_chunks(1, seed=1)
    writer = NodeStore(NodeClient(node.socket, slot_size=SLOT_SIZE, client_name="w"))
    assert writer.put_many([(chunk.key, chunk.data)]) == [True]
    reader = engine(node, "r")
    reader.exists([chunk.key])  # hello first: only the read's reply is refused
    refusals.refuse = 1
    read = reader.acquire([chunk.key])
    assert refusals.refused == 1 and read.slots == [None]  # timed out: a miss
    wait_until(lambda: node.host.pool.pinned_slots() == 0, "the dropped reply's pins to go")
    assert node.server.stats()["leases"] == 0
    assert node.server.stats()["counts"]["replies_dropped"] == 1
    # the engine kept its session and reads again
    again = reader.acquire([chunk.key])
    assert again.slots[0] is not None and bytes(again.views[0] or b"") == chunk.data
    reader.release(again)
    reader.close()
    writer.close()


def test_a_dropped_reservation_reply_gives_the_slot_back(node: Node, refusals: Refusals) -> None:
    [chunk] = sample_chunks(1, seed=2)
    writer = engine(node, "w")
    writer.exists([chunk.key])
    refusals.refuse = 1
    assert writer.reserve([chunk.key]).views == [None]
    wait_until(lambda: states(node, WRITING) == 0, "the dropped reservation to be aborted")
    assert node.server.stats()["leases"] == 0
    reservation = writer.reserve([chunk.key])  # the key is free to reserve again
    view = reservation.views[0]
    assert view is not None
    view[: len(chunk.data)] = chunk.data
    assert writer.commit(reservation, [len(chunk.data)]) == [True]
    writer.close()
