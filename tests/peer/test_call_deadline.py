"""One PeerStore call against one peer is bounded by one ``timeout_s`` in total.

A read may make several requests to a peer (``hello``, ``exists``/``lookup``, ``fetch``);
a peer answering each just inside the timeout must not stretch the call to several
timeouts (spec/PROTOCOL.md §7: a client bounds every request; here, every call).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.peer import PeerClient, PeerServer, PeerStore, PeerUnavailable
from chunkstore.testing.factories import sample_chunks
from tests.peer.doubles import SlowAnswers

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 0.5
CHUNKS = sample_chunks(2, seed=23)
KEYS = [c.key for c in CHUNKS]


def _get(store: PeerStore) -> Any:
    return store.get(KEYS[0])


def _get_many(store: PeerStore) -> Any:
    return store.get_many(KEYS)


def _get_into(store: PeerStore) -> Any:
    return store.get_into(KEYS[0], bytearray(len(CHUNKS[0].data)))


def _lookup_prefix(store: PeerStore) -> Any:
    return store.lookup_prefix(KEYS)


def _exists(store: PeerStore) -> Any:
    return store.exists(KEYS[0])


MISSES: dict[str, tuple[Callable[[PeerStore], Any], Any]] = {
    "get": (_get, None),
    "get_many": (_get_many, [None, None]),
    "get_into": (_get_into, None),
    "lookup_prefix": (_lookup_prefix, 0),
    "exists": (_exists, False),
}


def _slow_peer(
    serve: Callable[..., PeerServer], plane: str, delay_s: float
) -> tuple[PeerStore, SlowAnswers]:
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    server = serve(store, handle_on_io_thread=False)
    slow = SlowAnswers(server, delay_s)
    peers = PeerStore(
        [server.endpoint],
        plane=plane,
        timeout_s=TIMEOUT_S,
        retry_after_s=60,
        recv_arena_bytes=4 << 20,
        use_env_secret=False,
    )
    return peers, slow


@pytest.mark.parametrize("call", sorted(MISSES))
def test_a_call_to_a_peer_answering_each_request_late_ends_within_one_timeout(
    call: str, plane: str, serve: Callable[..., PeerServer]
) -> None:
    read, miss = MISSES[call]
    peers, slow = _slow_peer(serve, plane, 0.6 * TIMEOUT_S)
    try:
        assert read(peers) == miss  # hello, then the second request runs out of the call's time
        # (three requests would take 1.8 timeouts: the third is never sent)
        assert "fetch" not in slow.asked and len(slow.asked) <= 2
        asked = len(slow.asked)
        # given 0.4 of a timeout, the peer was not judged: not marked down, asked again
        assert all(c.available for c in peers.clients())
        read(peers)  # (with its session open now, a one-request call is answered in time)
        assert asked < len(slow.asked)
    finally:
        peers.close()


def test_a_peer_answering_within_the_call_is_read(
    plane: str, serve: Callable[..., PeerServer]
) -> None:
    peers, slow = _slow_peer(serve, plane, 0.1 * TIMEOUT_S)
    try:
        assert peers.get(KEYS[0]) == CHUNKS[0].data  # hello, exists, fetch: 0.3 timeouts
        assert "fetch" in slow.asked
        assert peers.get_many(KEYS) == [c.data for c in CHUNKS]
    finally:
        peers.close()


def test_a_request_with_no_time_left_is_not_sent_and_marks_nothing_down(
    serve: Callable[..., PeerServer],
) -> None:
    store = MemoryStore()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    server = serve(store, handle_on_io_thread=False)
    slow = SlowAnswers(server, 0)
    client = PeerClient(server.endpoint, plane="inline", timeout_s=TIMEOUT_S, use_env_secret=False)
    try:
        with client.within(time.monotonic()), pytest.raises(PeerUnavailable):
            client.exists(KEYS)
        assert slow.asked == []  # not even the hello went out
        assert client.available  # the peer was not asked, so it did not fail
        assert client.exists(KEYS) == [True, True]  # outside the block: timeout_s alone
    finally:
        client.close()
