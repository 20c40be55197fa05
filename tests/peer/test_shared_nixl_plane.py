"""Clients sharing one NIXL plane keep the server's agent while any of them uses it.

A :class:`~chunkstore.peer.PeerStore` gives every client the same
:class:`~chunkstore.peer.NixlClientPlane`, so two clients that reach the same server
(a peer retiring while its record comes back, one server under two endpoints) load the
same remote agent into one endpoint. One client ending its use of that agent (closing,
or marked down after a failed transfer) must not drop it from under the other: its
next READ would fail and mark a healthy peer down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.peer import NixlClientPlane, PeerClient, PeerServer, PeerUnavailable
from chunkstore.testing.factories import sample_chunks
from tests.peer.conftest import require_nixl

pytestmark = pytest.mark.timeout(60)

CHUNKS = sample_chunks(3, seed=31)
KEYS = [c.key for c in CHUNKS]


@pytest.fixture
def shared(serve: Callable[..., PeerServer]) -> Iterator[tuple[PeerClient, PeerClient]]:
    """Two NIXL clients of one server over one shared plane, both in session."""
    require_nixl()
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    server = serve(store)
    plane = NixlClientPlane(4 << 20)
    clients = [
        PeerClient(server.endpoint, plane="nixl", use_env_secret=False, nixl=plane)
        for _ in range(2)
    ]
    for client in clients:
        client.hello()
        assert client.plane == "nixl"
    yield clients[0], clients[1]
    for client in clients:
        client.close()
    plane.close()


def test_a_closed_client_leaves_the_shared_agent_to_the_other(
    shared: tuple[PeerClient, PeerClient],
) -> None:
    first, second = shared
    assert first.fetch(KEYS[:1]) == [CHUNKS[0].data]
    first.close()
    assert second.fetch(KEYS) == [c.data for c in CHUNKS]
    assert second.available and second.plane == "nixl"


def test_a_client_marked_down_leaves_the_shared_agent_to_the_other(
    shared: tuple[PeerClient, PeerClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = shared
    assert first._nixl is not None
    endpoint = first._nixl.endpoint
    real_read = endpoint.read
    failures = [True]  # the next READ fails (the first client's), later ones are real

    def read(*args: Any) -> bool:
        return False if failures and failures.pop() else real_read(*args)

    monkeypatch.setattr(endpoint, "read", read)
    with pytest.raises(PeerUnavailable):
        first.fetch(KEYS[:1])
    assert not first.available
    assert second.fetch(KEYS) == [c.data for c in CHUNKS]
    assert second.available and second.plane == "nixl"


def test_the_agent_goes_with_its_last_user(shared: tuple[PeerClient, PeerClient]) -> None:
    first, second = shared
    assert first._nixl is not None
    endpoint = first._nixl.endpoint
    (agent,) = endpoint._remotes
    first.close()
    assert agent in endpoint._remotes
    second.close()
    assert agent not in endpoint._remotes


def test_a_fresh_hello_does_not_count_the_agent_twice(
    shared: tuple[PeerClient, PeerClient],
) -> None:
    # The server dropped the session (idle, restarted): the client says hello again and
    # loads the same agent once more; its earlier hold on it must end with that.
    first, second = shared
    assert first._nixl is not None
    endpoint = first._nixl.endpoint
    (agent,) = endpoint._remotes
    first._session = None
    first.hello()
    assert first.plane == "nixl"
    first.close()
    second.close()
    assert agent not in endpoint._remotes
