"""The sessions and leases of one peer server, within its caps.

A session is what ``hello`` opens.
A lease holds pins, on host slots or staging allocations.
A client may read them over NIXL until it releases them or the lease expires.
The table admits sessions within ``max_sessions`` and ``max_sessions_per_client``.
It evicts the least recently used session where allowed.
It grants and gives back leases.
It expires idle sessions and old leases when the server's I/O loop sweeps it.
So a dead client cannot pin memory beyond its lease.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chunkstore.peer import _protocol as P
from chunkstore.peer._accounting import ServerAccounting
from chunkstore.peer._errors import ProtocolViolation
from chunkstore.peer._serverconfig import PeerServerConfig

log = logging.getLogger(__name__)


@dataclass
class Session:
    """One client's session (opened by ``hello``)."""

    client: str
    """The name the client gave."""
    identity: tuple[str, str]
    """Source address and ``client`` name: the unit of ``max_sessions_per_client``."""
    planes: tuple[str, ...]
    """Data planes this session may use."""
    nixl_remote: str | None
    """The client's NIXL agent as loaded here, when it sent metadata."""
    last_seen: float
    """``time.monotonic()`` of its last request."""
    retained: int
    """Bytes the client made us keep (its name and NIXL metadata), for ``stats``."""
    connection: int | None = None
    """The connection a node session lives on, by its file descriptor in the server.
    The session ends when that connection closes, never by idling or eviction.
    ``None`` for TCP peers."""


@dataclass
class SessionLease:
    """Pins a session holds until release or expiry."""

    session: bytes
    """The session's id."""
    expires: float
    """``time.monotonic()`` when the pins are dropped anyway."""
    releases: list[Callable[[], None]]
    """One call per pin, each giving it back."""
    held: list[Any] = field(default_factory=list)
    """What the lease holds, for the operation that finishes it (a reservation's slots)."""


def release_pins(lease: SessionLease) -> None:
    """Give back every pin of ``lease``. One failing unpin does not keep the others."""
    for release in lease.releases:
        try:
            release()
        except Exception:  # noqa: BLE001 - one failing unpin must not keep the others pinned
            log.exception("peer server: releasing a pin failed")


class SessionTable:
    """Sessions and leases of one server. Thread-safe.

    ``forget`` is called with every session that ends, by bye, eviction or idle expiry.
    The server then drops what it loaded for it, such as its NIXL agent.
    """

    def __init__(
        self,
        config: PeerServerConfig,
        accounting: ServerAccounting,
        forget: Callable[[Session], None],
    ) -> None:
        self._config = config
        self._accounting = accounting
        self._forget = forget
        self._sessions: dict[bytes, Session] = {}
        self._leases: dict[bytes, SessionLease] = {}
        self._lock = threading.Lock()

    # --- sessions -------------------------------------------------------------------------

    def admit(self, session_id: bytes, session: Session) -> None:
        """Add a session within the caps, evicting a least recently used one where allowed.

        A client identity at its cap loses its own oldest session.
        A client that says hello again has most likely lost the old one.
        A full server evicts the least recently used session idle at least
        ``session_evict_idle_s``.
        It prefers sessions without leases.
        When every session is busier than that, the hello is refused.
        That raises ProtocolViolation ``too_many_sessions``, and ``session`` is forgotten too.
        """
        cfg = self._config
        now = time.monotonic()
        with self._lock:
            mine = [k for k, v in self._sessions.items() if v.identity == session.identity]
            if len(mine) >= cfg.max_sessions_per_client:
                victim: bytes | None = self._least_recent(mine)
                cause = "per_client"
            elif len(self._sessions) >= cfg.max_sessions:
                idle = now - cfg.session_evict_idle_s
                victim = self._least_recent(
                    [
                        k
                        for k, v in self._sessions.items()
                        if v.last_seen <= idle and v.connection is None
                    ]
                )
                cause = "full"
            else:
                victim, cause = None, ""
            refused = bool(cause) and victim is None
            if not refused:
                evicted = self._sessions.pop(victim) if victim is not None else None
                leases = self._pop_leases_of(victim) if victim is not None else []
                self._sessions[session_id] = session
            count, open_leases = len(self._sessions), len(self._leases)
        if refused:
            self._forget(session)
            raise ProtocolViolation(
                P.TOO_MANY_SESSIONS, f"this peer holds {count} active sessions; retry later"
            )
        for lease in leases:
            release_pins(lease)
        if leases:
            self._accounting.leases_open(open_leases)
        if evicted is not None:
            self._forget(evicted)
            self._accounting.session_evicted(cause)
        self._sessions_changed()

    def _least_recent(self, candidates: list[bytes]) -> bytes | None:
        """The candidate to evict first: no leases before leases, then least recently seen."""
        if not candidates:
            return None
        leased = {v.session for v in self._leases.values()}
        return min(candidates, key=lambda k: (k in leased, self._sessions[k].last_seen))

    def touch(self, session_id: bytes) -> Session | None:
        """The session, marked as seen now. ``None`` when unknown or expired."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                session.last_seen = time.monotonic()
        return session

    def get(self, session_id: bytes) -> Session:
        """The session. Raises ProtocolViolation ``no_session`` when unknown or expired."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise ProtocolViolation(P.NO_SESSION, "unknown or expired session; say hello")
        return session

    def end(self, session_id: bytes) -> None:
        """End a session (``bye``): its leases are released."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            leases = self._pop_leases_of(session_id)
            open_leases = len(self._leases)
        for lease in leases:
            release_pins(lease)
        if leases:
            self._accounting.leases_open(open_leases)
            if session is not None and session.connection is not None:
                self._client_leases_changed({session.client})
        if session is not None:
            self._forget(session)
            self._sessions_changed()

    def drop_connection(self, connection: int) -> int:
        """End every session living on ``connection``, which closed.
        The client said bye, exited or was killed.
        Their leases are released. Returns how many sessions ended."""
        with self._lock:
            ended = [k for k, v in self._sessions.items() if v.connection == connection]
        for session_id in ended:
            self.end(session_id)
        return len(ended)

    def _sessions_changed(self) -> None:
        with self._lock:
            count = len(self._sessions)
            by_client: dict[str, int] = {}
            for session in self._sessions.values():
                if session.connection is not None:
                    by_client[session.client] = by_client.get(session.client, 0) + 1
        self._accounting.sessions_open(count)
        self._accounting.node_clients(by_client)

    # --- leases ---------------------------------------------------------------------------

    def open_lease(
        self,
        session_id: bytes,
        releases: list[Callable[[], None]],
        lease_ms: int | None,
        held: list[Any] | None = None,
    ) -> bytes:
        """A new lease id. Its pins, the ``releases`` if any, are held for ``lease_ms``.
        ``None`` holds them until released or the session ends, for node sessions only."""
        lease_id = P.new_token(P.LEASE_BYTES)
        if releases:
            expires = float("inf") if lease_ms is None else time.monotonic() + lease_ms / 1000
            lease = SessionLease(session_id, expires, releases, held or [])
            with self._lock:
                # The session may have ended while its request ran (its connection closed):
                # a lease stored now would never be released.
                alive = session_id in self._sessions
                if alive:
                    self._leases[lease_id] = lease
                open_leases = len(self._leases)
            if not alive:
                release_pins(lease)
                raise ProtocolViolation(P.NO_SESSION, "the session ended during the request")
            self._leases_changed(open_leases, [session_id])
        return lease_id

    def take_lease(self, session_id: bytes, lease_id: bytes) -> SessionLease | None:
        """Remove a lease of this session without releasing it. Its holder finishes it.
        ``None`` when it is unknown, ended or another session's."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.session != session_id:
                return None
            del self._leases[lease_id]
            open_leases = len(self._leases)
        self._leases_changed(open_leases, [session_id])
        return lease

    def _leases_changed(self, open_leases: int, session_ids: list[bytes]) -> None:
        self._accounting.leases_open(open_leases)
        with self._lock:
            clients = {
                s.client
                for sid in session_ids
                if (s := self._sessions.get(sid)) is not None and s.connection is not None
            }
        self._client_leases_changed(clients)

    def _client_leases_changed(self, clients: set[str]) -> None:
        """Recount the leases of these node clients, by name.
        An engine may hold several connections under one name.
        One of them ending leaves the others' leases."""
        with self._lock:
            held = {
                client: sum(
                    1
                    for lease in self._leases.values()
                    if (owner := self._sessions.get(lease.session)) is not None
                    and owner.client == client
                )
                for client in clients
            }
        for client, count in held.items():
            self._accounting.client_leases(client, count)

    def close_lease(self, session_id: bytes, lease_id: bytes) -> bool:
        """Release a lease of this session. False when it is unknown, expired or another's."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.session == session_id:
                del self._leases[lease_id]
            else:
                lease = None
            open_leases = len(self._leases)
        if lease is None:
            return False
        release_pins(lease)
        self._leases_changed(open_leases, [session_id])
        return True

    def _pop_leases_of(self, session_id: bytes | None) -> list[SessionLease]:
        """Remove the leases of one session (caller holds the lock)."""
        return [
            self._leases.pop(k) for k, v in list(self._leases.items()) if v.session == session_id
        ]

    # --- upkeep ---------------------------------------------------------------------------

    def sweep(self) -> None:
        """Release expired leases, and end sessions idle longer than ``session_idle_s``.
        Retire the chunk counts of node clients detached past their grace period."""
        now = time.monotonic()
        expired: list[SessionLease] = []
        dropped: list[Session] = []
        with self._lock:
            for lease_id in [k for k, v in self._leases.items() if v.expires <= now]:
                expired.append(self._leases.pop(lease_id))
            idle = now - self._config.session_idle_s
            # A node session lives as long as its connection: the kernel closing it is the
            # client's end, however long it stays quiet.
            for sid in [
                k for k, v in self._sessions.items() if v.last_seen < idle and v.connection is None
            ]:
                dropped.append(self._sessions.pop(sid))
                expired.extend(self._pop_leases_of(sid))
            open_leases = len(self._leases)
        for lease in expired:
            self._accounting.count("leases_expired")
            release_pins(lease)
        for session in dropped:
            self._forget(session)
        if expired:
            self._accounting.leases_open(open_leases)
        if dropped:
            self._sessions_changed()
        if self._accounting.client_series is not None:
            self._accounting.client_series.retire()

    def clear(self) -> None:
        """End every session and release every lease (the server stops)."""
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
            self._sessions.clear()
        for lease in leases:
            release_pins(lease)
        self._accounting.leases_open(0)
        self._accounting.sessions_open(0)
        self._accounting.node_clients({})

    def sizes(self) -> dict[str, int]:
        """``sessions``, ``session_bytes``, ``leases`` and ``pins`` held now (for ``stats``)."""
        with self._lock:
            return {
                "sessions": len(self._sessions),
                "session_bytes": sum(v.retained for v in self._sessions.values()),
                "leases": len(self._leases),
                "pins": sum(len(v.releases) for v in self._leases.values()),
            }
