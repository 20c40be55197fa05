"""A peer client's NIXL data plane: the shared agent, and fetches and pushes over it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chunkstore.backends.base import Buffer
from chunkstore.hashing import ChunkKey
from chunkstore.peer import _protocol as P
from chunkstore.peer._arena import Allocation, Arena
from chunkstore.peer._errors import PeerRefused, PeerUnavailable
from chunkstore.peer._nixlplane import NixlEndpoint, address_of

if TYPE_CHECKING:
    from chunkstore.peer._clientconfig import PeerClientConfig
    from chunkstore.peer._metrics import PeerMetrics


class NixlClientPlane:
    """A client's NIXL agent and its registered receive and send arena.

    The client's connections share it.
    """

    def __init__(self, arena_bytes: int) -> None:
        self.endpoint = NixlEndpoint("client")
        self.arena = Arena(arena_bytes)
        self.endpoint.register(self.arena.array)

    def close(self) -> None:
        """Deregister and drop the agent."""
        self.endpoint.close()


class NixlTransfers:
    """The part of :class:`~chunkstore.peer._client.PeerClient` that moves chunks over NIXL."""

    if TYPE_CHECKING:
        config: PeerClientConfig
        endpoint: str
        metrics: PeerMetrics
        _nixl: NixlClientPlane | None
        _remote_agent: str | None
        _bound: threading.local

        def request(
            self,
            op: str,
            fields: dict[str, Any],
            data: Sequence[Any] = (),
            *,
            expect_reply: bool = True,
        ) -> tuple[dict[str, Any], list[Any]]: ...

        def _mark_down(self, reason: str, *, keep_session: bool = False) -> None: ...

        def _malformed(self, what: str) -> PeerUnavailable: ...

        def _stored(self, reply: dict[str, Any], n: int) -> list[tuple[bool, bool]]: ...

    def _fetch_nixl(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer] | None, *, use: bool = True
    ) -> list[Any]:
        """Fetch ``keys`` over NIXL, into ``buffers`` when given.

        Returns per key the bytes, or the size written into its buffer, or ``None``.
        A failed or late READ marks the peer down and raises PeerUnavailable.
        """
        assert self._nixl is not None
        arena, endpoint = self._nixl.arena, self._nixl.endpoint
        started = time.monotonic()
        body: dict[str, Any] = {
            "keys": P.pack_keys(keys),
            "plane": P.PLANE_NIXL,
            "lease_ms": self.config.lease_ms,
        }
        if not use:
            body["use"] = False
        reply, _ = self.request("fetch", body)
        # The agent of the server that answered. Another thread may let go of it (a request
        # of its own timed out): if no other client sharing the plane holds it, its READs then
        # fail as a miss (NixlEndpoint refuses a removed agent), never with the attribute gone
        # under us.
        remote = self._remote_agent
        items = reply.get("items")
        lease = reply.get("lease")
        if not isinstance(items, list) or len(items) != len(keys) or not isinstance(lease, bytes):
            raise self._malformed("fetch")
        granted = reply.get("lease_ms")
        if not (P.is_wire_int(granted) and granted > 0):
            granted = self.config.lease_ms  # a server that does not say grants what we asked
        lease_s = min(granted, self.config.lease_ms) / 1000
        # Never READ after the lease ends: the server may have reused the memory by then.
        # The READ also ends within the operation's deadline (``within``), if one is set.
        deadline = min(started + self.config.timeout_s, started + lease_s * 0.9)
        bound: float | None = getattr(self._bound, "at", None)
        if bound is not None:
            deadline = min(deadline, bound)
        out: list[Any] = [None] * len(keys)
        # One READ per round: a batch larger than the receive arena is read in several rounds
        # (each frees its staging space), so NIXL misses no chunk that inline would return.
        pairs: list[tuple[int, int, int]] = []
        targets: list[tuple[int, Any, int]] = []  # (index, allocation or buffer view, size)
        allocations: list[Allocation] = []
        ok = True

        def read_round() -> bool:
            done = endpoint.read(remote, pairs, deadline) if pairs and remote else not pairs
            if done:
                for i, target, size in targets:
                    if isinstance(target, memoryview):
                        out[i] = size
                    elif buffers is not None:
                        memoryview(buffers[i]).cast("B")[:size] = arena.view(target)
                        out[i] = size
                    else:
                        out[i] = bytes(arena.view(target))
                self.metrics.client_bytes.labels(P.PLANE_NIXL, "in").inc(
                    sum(size for _, _, size in targets)
                )
            for allocation in allocations:
                arena.free(allocation)
            pairs.clear()
            targets.clear()
            allocations.clear()
            return done

        try:
            for i, item in enumerate(items):
                if not (
                    isinstance(item, list)
                    and len(item) == 2
                    and all(isinstance(x, int) and x >= 0 for x in item)
                ):
                    continue
                remote_address, size = item
                if size > self.config.limits.max_frame_bytes:
                    continue
                if size == 0:  # nothing to move; the caller's verification rejects it
                    out[i] = 0 if buffers is not None else b""
                    continue
                if buffers is not None:
                    view = memoryview(buffers[i]).cast("B")
                    if size > len(view):
                        continue
                    local, _ = address_of(view)
                    if endpoint.registered(local, size):
                        pairs.append((local, remote_address, size))
                        targets.append((i, view, size))
                        continue
                allocation = arena.allocate(size)
                if allocation is None and allocations:
                    ok = read_round()  # the arena is full of this batch: read it, then go on
                    if not ok:
                        break
                    allocation = arena.allocate(size)
                if allocation is None:  # larger than the arena (or others hold it all)
                    self.metrics.client_failures.labels("arena_full").inc()
                    continue
                allocations.append(allocation)
                pairs.append((arena.address_of(allocation), remote_address, size))
                targets.append((i, allocation, size))
            if ok:
                ok = read_round()
        finally:
            for allocation in allocations:
                arena.free(allocation)
            if items and any(items):
                try:
                    self.request("release", {"lease": lease, "ack": False}, expect_reply=False)
                except (PeerUnavailable, PeerRefused):
                    pass  # the lease expires on its own
        if not ok:
            self._mark_down("transfer_failed")
            raise PeerUnavailable(f"{self.endpoint}: NIXL read failed or timed out")
        return out

    def _push_nixl(
        self, keys: Sequence[ChunkKey], views: list[memoryview], mode: str
    ) -> list[tuple[bool, bool]]:
        """Push over NIXL in as many requests as the send arena needs.

        Each request's chunks are staged in the arena together.
        The server READs them while it answers.
        """
        assert self._nixl is not None
        arena = self._nixl.arena
        out: list[tuple[bool, bool]] = [(False, False)] * len(views)
        group: list[int] = []
        allocations: list[Allocation] = []

        def send_group() -> None:
            try:
                if group:
                    fields = {
                        "keys": P.pack_keys([keys[i] for i in group]),
                        "sizes": [len(views[i]) for i in group],
                        "mode": mode,
                        "plane": P.PLANE_NIXL,
                        "addrs": [arena.address_of(a) for a in allocations],
                    }
                    reply, _ = self.request("push", fields)
                    self.metrics.client_bytes.labels(P.PLANE_NIXL, "out").inc(
                        sum(len(views[i]) for i in group)
                    )
                    for i, result in zip(group, self._stored(reply, len(group))):
                        out[i] = result
            finally:
                for allocation in allocations:
                    arena.free(allocation)
                group.clear()
                allocations.clear()

        try:
            for i, view in enumerate(views):
                allocation = arena.allocate(len(view))
                if allocation is None and allocations:
                    send_group()  # the arena is full of this batch: push it, then go on
                    allocation = arena.allocate(len(view))
                if allocation is None:  # larger than the arena (or others hold it all)
                    self.metrics.client_failures.labels("arena_full").inc()
                    continue
                arena.view(allocation)[:] = view
                group.append(i)
                allocations.append(allocation)
            send_group()
        finally:
            for allocation in allocations:
                arena.free(allocation)
        return out
