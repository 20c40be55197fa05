"""A peer whose replies break the schema (a buggy or hostile server: any registry record can
point at one) is a failed request, a miss for PeerStore, never another exception."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.peer import PeerClient, PeerServer, PeerStore, PeerUnavailable
from chunkstore.testing.factories import sample_chunks

pytestmark = pytest.mark.timeout(60)

CHUNKS = sample_chunks(2, seed=6)
KEYS = [c.key for c in CHUNKS]


@pytest.fixture
def lying(serve: Callable[..., PeerServer]) -> Iterator[Callable[[str, dict[str, Any]], Any]]:
    """A server answering operation ``op`` with exactly ``fields`` (and ok: true)."""

    def start(op: str, fields: dict[str, Any]) -> PeerServer:
        backing = MemoryStore()
        backing.put_many([(c.key, c.data) for c in CHUNKS])
        server = serve(backing, planes=("inline",))
        handlers = server._handlers  # noqa: SLF001 - the test replaces one handler
        assert handlers is not None

        def answer(*args: Any) -> Any:
            return fields, (), None

        if op == "hello":
            handlers._op_hello = answer  # type: ignore[method-assign]  # noqa: SLF001
        else:
            handlers._ops[op] = answer  # noqa: SLF001
        return server

    yield start


@pytest.mark.parametrize(
    "fields",
    [{}, {"prefix": "2"}, {"prefix": 3}, {"prefix": -1}, {"prefix": True}],
    ids=["missing", "text", "more-than-asked", "negative", "boolean"],
)
def test_a_bad_lookup_reply_is_no_prefix(
    lying: Callable[[str, dict[str, Any]], PeerServer], fields: dict[str, Any]
) -> None:
    server = lying("lookup", fields)
    store = PeerStore([server.endpoint], plane="inline", use_env_secret=False)
    try:
        assert store.lookup_prefix(KEYS) == 0
    finally:
        store.close()
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    with pytest.raises(PeerUnavailable, match="malformed lookup reply"):
        client.lookup(KEYS)
    client.close()


@pytest.mark.parametrize(
    ("op", "fields", "call"),
    [
        ("exists", {}, lambda s: s.exists_many(KEYS) == [False, False]),
        ("exists", {"present": [True]}, lambda s: s.exists_many(KEYS) == [False, False]),
        ("delete", {"deleted": 7}, lambda s: s.delete_many(KEYS) == 0),
        ("delete", {}, lambda s: s.delete_many(KEYS) == 0),
        ("stats", {"stats": [1, 2]}, lambda s: s.stats() == {s.clients()[0].endpoint: None}),
        (
            "push",
            {"stored": [True, True]},
            lambda s: s.put_many([(c.key, c.data) for c in CHUNKS]) == [False] * 2,
        ),
        ("fetch", {"sizes": 5}, lambda s: s.get_many(KEYS) == [None, None]),
    ],
    ids=[
        "exists-missing",
        "exists-short",
        "delete-int",
        "delete-missing",
        "stats-list",
        "push-no-written",
        "fetch-sizes-int",
    ],
)
def test_a_bad_reply_is_a_failed_request(
    lying: Callable[[str, dict[str, Any]], PeerServer],
    op: str,
    fields: dict[str, Any],
    call: Callable[[PeerStore], bool],
) -> None:
    store = PeerStore(
        [lying(op, fields).endpoint], plane="inline", use_env_secret=False, retry_after_s=0
    )
    try:
        assert call(store)
    finally:
        store.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"planes": ["inline"]},
        {"s": b"short", "planes": ["inline"]},
        {"s": bytes(16), "planes": "inline"},
        {"s": bytes(16), "planes": ["inline"], "limits": {"max_keys": 0}},
        {"s": bytes(16), "planes": ["inline"], "limits": []},
    ],
    ids=["no-session", "short-session", "planes-text", "max-keys-0", "limits-list"],
)
def test_a_bad_hello_reply_leaves_the_peer_unusable_not_broken(
    lying: Callable[[str, dict[str, Any]], PeerServer], fields: dict[str, Any]
) -> None:
    server = lying("hello", fields)
    client = PeerClient(server.endpoint, plane="inline", use_env_secret=False)
    with pytest.raises(PeerUnavailable, match="malformed hello reply"):
        client.hello()
    assert not client.session_open
    client.close()
    store = PeerStore([server.endpoint], plane="inline", use_env_secret=False)
    try:
        assert store.get_many(KEYS) == [None, None]
        assert store.lookup_prefix(KEYS) == 0
    finally:
        store.close()
