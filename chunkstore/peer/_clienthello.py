"""How a peer client opens a session: the planes it asks for and the hello exchange."""

from __future__ import annotations

import logging
import os
import socket as _socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chunkstore.errors import ConfigError
from chunkstore.peer import _protocol as P
from chunkstore.peer._clientnixl import NixlClientPlane
from chunkstore.peer._errors import PeerRefused, PeerUnavailable
from chunkstore.peer._nixlplane import nixl_unavailable_reason

if TYPE_CHECKING:
    from chunkstore.peer._clientconfig import PeerClientConfig

log = logging.getLogger("chunkstore.peer._client")  # the client's logger, as before the split


class SessionOpening:
    """The part of :class:`~chunkstore.peer._client.PeerClient` that says hello."""

    if TYPE_CHECKING:
        config: PeerClientConfig
        endpoint: str
        server_info: dict[str, Any]
        plane: str | None
        plane_reason: str
        _nixl: NixlClientPlane | None
        _own_nixl: bool
        _session: bytes | None
        _unsent: list[bytes]

        def _exchange(
            self, op: str, fields: dict[str, Any], data: Sequence[Any], expect_reply: bool
        ) -> tuple[dict[str, Any], list[Any]]: ...

        def _hold_remote(self, name: str | None) -> None: ...

        def _malformed(self, what: str) -> PeerUnavailable: ...

    def _planes_wanted(self) -> tuple[list[str], str]:
        """Return the planes to offer, best first, and why NIXL is left out if it is.

        Starts this client's NIXL plane when it needs one and has none.
        Raises ConfigError when ``nixl`` is configured but cannot run.
        """
        plane = self.config.plane
        if plane == P.PLANE_INLINE:
            return [P.PLANE_INLINE], "inline plane configured"
        if plane == P.PLANE_SHM:
            return [P.PLANE_SHM], "shm plane configured"
        reason = nixl_unavailable_reason()
        if reason is not None:
            if plane == P.PLANE_NIXL:
                raise ConfigError(f"the NIXL data plane was requested but {reason}")
            return [P.PLANE_INLINE], reason
        if self._nixl is None:
            try:
                self._nixl = NixlClientPlane(self.config.recv_arena_bytes)
                self._own_nixl = True
            except Exception as exc:  # noqa: BLE001 - fall back, reported
                if plane == P.PLANE_NIXL:
                    raise ConfigError(f"the NIXL data plane could not start: {exc}") from None
                return [P.PLANE_INLINE], f"NIXL could not start: {exc}"
        if plane == P.PLANE_NIXL:
            return [P.PLANE_NIXL], "nixl plane configured"
        return [P.PLANE_NIXL, P.PLANE_INLINE], ""

    def _hello(self) -> None:
        """Open a session and settle the data plane.

        Raises PeerRefused when the peer offers no plane in common.
        """
        planes, why = self._planes_wanted()
        fields = {
            "versions": sorted(P.ACCEPTED_VERSIONS),
            "client": self.config.client_name or f"{_socket.gethostname()}:{os.getpid()}",
            "fingerprint": self.config.fingerprint,
            "chunk_tokens": self.config.chunk_tokens,
            "planes": planes,
            "nixl_md": self._nixl.endpoint.metadata()
            if (self._nixl is not None and P.PLANE_NIXL in planes)
            else None,
        }
        if self.config.slot_size is not None:
            fields["slot_size"] = self.config.slot_size
        reply, _ = self._exchange("hello", fields, (), True)
        offered = reply.get("planes")
        session = reply.get("s")
        limits = reply.get("limits", {})
        if not (
            isinstance(offered, list)
            and isinstance(session, bytes)
            and len(session) == P.SESSION_BYTES
            and isinstance(limits, dict)
            and (P.is_wire_int(limits.get("max_keys", 1)) and limits.get("max_keys", 1) >= 1)
        ):
            raise self._malformed("hello")
        if P.PLANE_SHM in planes:
            if P.PLANE_SHM not in offered:
                raise PeerRefused(
                    P.DATAPLANE_UNAVAILABLE, f"{self.endpoint} does not offer the shm plane"
                )
            self.server_info, self._session = reply, session
            self._unsent.clear()  # releases of an ended session (its leases went with it)
            self.plane, self.plane_reason = P.PLANE_SHM, why
            return
        self.server_info = reply
        self._session = session
        self._unsent.clear()
        if P.PLANE_NIXL in offered and P.PLANE_NIXL in planes and reply.get("nixl_md"):
            assert self._nixl is not None
            remote = self._nixl.endpoint.add_remote(reply["nixl_md"])
            if remote is not None:
                # Loaded before the earlier hold goes: the same server's agent (a session
                # the server dropped) is then never removed and loaded again in between.
                self._hold_remote(remote)
                self.plane, self.plane_reason = P.PLANE_NIXL, "both sides offer NIXL"
                return
            why = "NIXL rejected the peer's agent metadata"
        elif P.PLANE_NIXL in planes:
            why = (
                why
                or f"the peer does not offer NIXL ({reply.get('nixl_reason') or 'not configured'})"
            )
        self._hold_remote(None)  # this session reads no NIXL
        if P.PLANE_INLINE not in offered:
            raise PeerRefused(P.DATAPLANE_UNAVAILABLE, f"no common data plane ({why})")
        self.plane, self.plane_reason = P.PLANE_INLINE, why
        log.info("peer %s: inline data plane (%s)", self.endpoint, why)
