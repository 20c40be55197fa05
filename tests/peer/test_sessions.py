"""The server's session/lease table on its own: caps, eviction, lease ownership and expiry."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from chunkstore.peer import _protocol as P
from chunkstore.peer._accounting import ServerAccounting
from chunkstore.peer._errors import ProtocolViolation
from chunkstore.peer._metrics import PeerMetrics
from chunkstore.peer._serverconfig import PeerServerConfig
from chunkstore.peer._sessions import Session, SessionTable


def session(client: str = "c", source: str = "a", seen: float | None = None) -> Session:
    return Session(
        client=client,
        identity=(source, client),
        planes=(P.PLANE_INLINE,),
        nixl_remote=None,
        last_seen=time.monotonic() if seen is None else seen,
        retained=len(client),
    )


def table(**config: Any) -> tuple[SessionTable, list[Session], ServerAccounting]:
    forgotten: list[Session] = []
    accounting = ServerAccounting(PeerMetrics(CollectorRegistry()), lambda: "t")
    return (
        SessionTable(PeerServerConfig(**config), accounting, forgotten.append),
        forgotten,
        accounting,
    )


def test_a_client_at_its_cap_loses_an_unleased_session_first_then_its_oldest() -> None:
    sessions, forgotten, accounting = table(max_sessions_per_client=2)
    released: list[str] = []
    old, mid, new = session(seen=1.0), session(seen=2.0), session()
    sessions.admit(b"old", old)
    sessions.admit(b"mid", mid)
    sessions.open_lease(b"old", [lambda: released.append("old")], lease_ms=60_000)
    sessions.admit(b"new", new)
    assert forgotten == [mid] and released == []
    sessions.open_lease(b"new", [lambda: released.append("new")], lease_ms=60_000)
    sessions.admit(b"newest", session())
    assert forgotten == [mid, old] and released == ["old"]
    assert sessions.sizes()["sessions"] == 2 and sessions.sizes()["leases"] == 1
    assert accounting.snapshot()["sessions_evicted_per_client"] == 2
    with pytest.raises(ProtocolViolation) as raised:
        sessions.get(b"old")
    assert raised.value.code == P.NO_SESSION


def test_a_full_table_refuses_when_every_session_is_busy() -> None:
    sessions, forgotten, _ = table(max_sessions=1, session_evict_idle_s=3600.0)
    sessions.admit(b"busy", session("one"))
    refused = session("two")
    with pytest.raises(ProtocolViolation) as raised:
        sessions.admit(b"late", refused)
    assert raised.value.code == P.TOO_MANY_SESSIONS
    assert forgotten == [refused] and sessions.touch(b"busy") is not None


def test_only_the_owning_session_releases_a_lease_and_only_once() -> None:
    sessions, _, _ = table()
    released: list[int] = []
    sessions.admit(b"mine", session("one"))
    sessions.admit(b"other", session("two"))
    lease = sessions.open_lease(b"mine", [lambda: released.append(1)], lease_ms=60_000)
    assert not sessions.close_lease(b"other", lease)
    assert sessions.close_lease(b"mine", lease)
    assert not sessions.close_lease(b"mine", lease)
    assert released == [1]


def test_a_sweep_releases_expired_leases_and_ends_idle_sessions() -> None:
    sessions, forgotten, accounting = table(session_idle_s=60.0)
    released: list[str] = []
    idle = session("idle", seen=time.monotonic() - 120.0)
    sessions.admit(b"live", session("live"))
    sessions.admit(b"idle", idle)
    sessions.open_lease(b"live", [lambda: released.append("expired")], lease_ms=0)
    sessions.open_lease(b"live", [lambda: released.append("held")], lease_ms=60_000)
    sessions.sweep()
    assert released == ["expired"] and forgotten == [idle]
    assert sessions.sizes() == {"sessions": 1, "session_bytes": 4, "leases": 1, "pins": 1}
    assert accounting.snapshot()["leases_expired"] == 1
    sessions.clear()
    assert released == ["expired", "held"] and sessions.sizes()["sessions"] == 0


def test_a_node_clients_lease_gauge_drops_the_leases_of_a_connection_that_closed() -> None:
    registry = CollectorRegistry()
    accounting = ServerAccounting(PeerMetrics(registry), lambda: "t")
    sessions = SessionTable(PeerServerConfig(), accounting, lambda _: None)
    for sid, fd in ((b"a" * 16, 5), (b"b" * 16, 6)):  # one engine, two connections, one name
        node = session("engine", source=f"fd{fd}")
        node.connection = fd
        sessions.admit(sid, node)
    sessions.open_lease(b"a" * 16, [lambda: None], None)
    sessions.open_lease(b"b" * 16, [lambda: None], None)

    def gauge() -> float | None:
        labels = {"server": "t", "client": "engine"}
        return registry.get_sample_value("chunkstore_node_client_leases", labels)

    assert gauge() == 2
    assert sessions.drop_connection(5) == 1
    assert gauge() == 1 == sessions.sizes()["leases"]
    sessions.end(b"b" * 16)
    assert gauge() is None  # the client is gone: its series with it
