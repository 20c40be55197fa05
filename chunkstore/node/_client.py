"""NodeClient: an engine's connection to its machine's node service.

Control messages go over the node's unix socket, with the peer protocol and
plane ``shm``. Chunk bytes never do. The client maps the service's slot pool
and reads or writes slots in place. Every lease is held by the service on the
client's behalf. It ends when the client releases it or its connection closes.
So a killed engine leaks no slot.

The client never blocks an engine on a dead service. Requests are bounded by
``timeout_s``. A closed connection fails the next request at once, through ZMQ
``IMMEDIATE``. After a failure the service counts as down for
``retry_after_s``. Every call is then a miss, without I/O. Then the client
attaches again. It sends a fresh ``hello``, and maps the new pool when the
service was restarted. A request that merely times out keeps the connection
open. Closing it would end the session. The service would then release the
pins and abort the reservations of copies the engine is still making.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkstore.cache._pool import SHM_DIR, SlotPool
from chunkstore.errors import ConfigError, StoreError
from chunkstore.hashing import ChunkKey
from chunkstore.peer import _protocol as P
from chunkstore.peer._client import PeerClient, PeerClientConfig
from chunkstore.peer._errors import PeerError, PeerRefused
from chunkstore.peer._localsocket import answers, socket_path
from chunkstore.peer._metrics import PeerMetrics
from chunkstore.units import shown

log = logging.getLogger(__name__)

REFUSALS = frozenset(
    {
        P.GEOMETRY_MISMATCH,
        P.FINGERPRINT_MISMATCH,
        P.CHUNK_TOKENS_MISMATCH,
        P.AUTH_FAILED,
        P.UNSUPPORTED_VERSION,
        P.DATAPLANE_UNAVAILABLE,
    }
)
"""Error codes that mean "this engine must not use this node" (not a passing failure)."""


class NodeRefused(ConfigError):
    """The node service refused this engine: other model, chunk size, secret or version."""


def node_endpoint(url: str) -> str:
    """``unix:///path``, ``ipc:///path`` or ``/path`` as the ZeroMQ endpoint ``ipc:///path``."""
    if not isinstance(url, str):
        raise ConfigError(f"a node address is a unix:///path string, got {shown(url)}")
    for scheme in ("unix://", "ipc://"):
        if url.startswith(scheme):
            url = url.removeprefix(scheme)
            break
    else:
        if "://" in url:
            raise ConfigError(f"a node address is unix:///path, got {shown(url)}")
    endpoint = f"ipc://{url}"
    socket_path(endpoint)  # absolute and short enough, or ConfigError
    return endpoint


def engine_identity(name: str) -> bytes:
    """The ``engine`` identity of spec/PROTOCOL.md §9.7 for an engine named ``name``.

    Every rank of one engine must pass the same name. In vLLM that is the engine's
    ``kv_transfer_config.engine_id``. vLLM makes it the same on every rank of a TP
    group, and unique per engine and data-parallel replica. The node combines the parts
    of a chunk only among reservations naming the same identity. A digest keeps the
    wire field short whatever the name.
    """
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class RankShare:
    """A TP rank's part in reserving chunks: which rank of which engine, and what the node
    seals them with."""

    rank: int
    """This process's TP rank."""
    tp: int
    """The engine's TP size: how many parts make a chunk."""
    parents: Sequence[bytes]
    """Per key: the parent digest for the chunk header."""
    tokens: Sequence[Sequence[int]]
    """Per key: the token ids the chunk covers."""
    engine: bytes
    """The engine's identity, the same on all its ranks (:func:`engine_identity`): parts
    make a chunk only with parts of the same engine."""

    def fields(self) -> dict[str, Any]:
        """The ``reserve`` fields of spec/PROTOCOL.md §9.7."""
        return {
            "tp": self.tp,
            "rank": self.rank,
            "parents": b"".join(self.parents),
            "tokens": [np.asarray(t, dtype="<u4").tobytes() for t in self.tokens],
            "engine": self.engine,
        }


@dataclass(frozen=True, slots=True)
class NodeRead:
    """Chunks the service pinned for this client: read ``views``, then release them."""

    lease: bytes | None
    """The service's lease id (``None``: nothing pinned)."""
    views: list[memoryview | None]
    """Per key: the chunk's bytes in the mapped pool, or ``None`` (a miss)."""
    slots: list[tuple[int, int] | None]
    """Per key: ``(slot, generation)`` as leased, for the check after copying."""
    pool: SlotPool | None
    """The mapping the views lie in."""


@dataclass(frozen=True, slots=True)
class NodeReservation:
    """Writable slots the service reserved; fill them, then :meth:`NodeClient.commit`."""

    lease: bytes | None
    """The service's lease id (``None``: nothing reserved)."""
    views: list[memoryview | None]
    """Per key: the whole writable slot, or ``None`` (already present, or no room)."""
    present: list[bool]
    """Per key: the service already holds it, so there is nothing to write."""


class NodeClient:
    """One engine's attachment to a node service. Thread-safe: one request at a time.

    ``slot_size`` is this engine's chunk size in bytes. A node whose pool slots
    differ refuses it. So does one serving another ``fingerprint`` or
    ``chunk_tokens``. :meth:`attach` raises :class:`NodeRefused` for those.
    Every other method turns any failure into a miss.
    """

    def __init__(
        self,
        url: str,
        *,
        slot_size: int,
        fingerprint: bytes | None = None,
        chunk_tokens: int | None = None,
        secret: bytes | str | None = None,
        timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        client_name: str | None = None,
        metrics: PeerMetrics | None = None,
    ) -> None:
        self.endpoint = node_endpoint(url)
        self.path = socket_path(self.endpoint)
        self.retry_after_s = retry_after_s
        config = PeerClientConfig(
            fingerprint=fingerprint,
            chunk_tokens=chunk_tokens,
            secret=secret,
            plane=P.PLANE_SHM,
            slot_size=slot_size,
            timeout_s=timeout_s,
            retry_after_s=retry_after_s,
            client_name=client_name or f"engine-{os.getpid()}",
            immediate=True,
            keep_session_on_timeout=True,
        )
        self._peer = PeerClient(self.endpoint, config, metrics=metrics)
        self.slot_size = slot_size
        """This engine's chunk size. Once attached, it is the pool's slot size."""
        self._lock = threading.RLock()
        self._pool: SlotPool | None = None
        self._pool_id: tuple[str, int] | None = None
        self._pool_session: bytes | None = None
        self._down_until = 0.0
        self.refusal: str | None = None
        """The service's last refusal of this engine; ``None`` once attached."""

    # --- attachment ---------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        """Whether a session is open and the pool mapped."""
        return self._peer.session_open and self._pool is not None

    def attach(self) -> bool:
        """Attach now: True when attached, False when the service is unreachable.

        Raises :class:`NodeRefused` when the service refuses this engine. Its message
        is one line naming both sides.
        """
        with self._lock:
            try:
                return self._ensure_attached()
            except PeerRefused as exc:
                raise NodeRefused(f"node {self.path} refused this engine: {exc.reason}") from None

    def _ensure_attached(self) -> bool:
        if self._peer.session_open and self._pool is not None:
            return True
        if time.monotonic() < self._down_until or not self._peer.available:
            return False
        if not answers(self.path):  # nobody listens: a miss now, without waiting
            self._down_until = time.monotonic() + self.retry_after_s
            return False
        try:
            self._peer.hello()
        except PeerRefused as exc:
            self._down_until = time.monotonic() + self.retry_after_s
            self.refusal = f"{exc.code}: {exc.reason}"
            raise
        except PeerError:
            return False
        self._sync_pool()
        self.refusal = None
        return True

    def _sync_pool(self) -> None:
        """Map the pool of the current session. Maps it again when the service was restarted."""
        info = self._peer.server_info
        session = info.get("s")
        if session == self._pool_session and self._pool is not None:
            return
        name = info.get("pool")
        if not isinstance(name, str) or info.get("slot_size") != self.slot_size:
            raise PeerRefused(P.MALFORMED, "the node's hello names no usable pool")
        try:
            inode = os.stat(SHM_DIR / name).st_ino
            if self._pool is None or self._pool_id != (name, inode):
                if self._pool is not None:
                    self._pool.close()
                    self._pool = None
                self._pool = SlotPool.attach(name)
                self._pool_id = (name, inode)
        except (OSError, StoreError) as exc:
            # Another /dev/shm (separate containers) or another release's pool format: the
            # engine cannot use this service, say so in one line (a miss from then on).
            raise PeerRefused(
                P.DATAPLANE_UNAVAILABLE,
                f"cannot map its slot pool {SHM_DIR / name} ({exc}); the engine and the "
                "service must share /dev/shm (e.g. docker --ipc=host) and run the same "
                "chunkstore release",
            ) from None
        self._pool_session = session

    def _request(self, op: str, fields: dict[str, Any]) -> dict[str, Any] | None:
        """One request. ``None`` when the service is down or refuses, after logging."""
        try:
            if not self._ensure_attached():
                return None
            reply, _ = self._peer.request(op, fields)
            self._sync_pool()  # the request may have said hello again (a restarted service)
            return reply
        except PeerRefused as exc:
            if exc.code in REFUSALS:
                self._down_until = time.monotonic() + self.retry_after_s
                self.refusal = f"{exc.code}: {exc.reason}"
            log.warning("node %s: %s refused: %s", self.path, op, exc.reason)
            return None
        except (PeerError, OSError) as exc:
            log.debug("node %s: %s failed: %s", self.path, op, exc)
            return None

    # --- operations -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys the node holds; 0 when it is down."""
        if not keys:
            return 0
        with self._lock:
            reply = self._request("lookup", {"keys": P.pack_keys(keys)})
        return int(reply["prefix"]) if reply is not None else 0

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key: whether the node holds it. All False when it is down."""
        with self._lock:
            reply = self._request("exists", {"keys": P.pack_keys(keys)}) if keys else None
        return _flags(reply, "present", len(keys))

    def acquire(self, keys: Sequence[ChunkKey]) -> NodeRead:
        """Pin the chunks of ``keys`` in the node's pool for reading in place."""
        with self._lock:
            fields = {"keys": P.pack_keys(keys), "plane": P.PLANE_SHM, "lease_ms": 0}
            reply = self._request("fetch", fields) if keys else None
            pool = self._pool
        items = reply.get("items") if reply is not None else None
        if pool is None or not isinstance(items, list) or len(items) != len(keys):
            return NodeRead(None, [None] * len(keys), [None] * len(keys), None)
        views: list[memoryview | None] = []
        slots: list[tuple[int, int] | None] = []
        for item in items:
            if not _well_formed(item, 3, pool) or not 0 < item[2] <= pool.slot_size:
                views.append(None)
                slots.append(None)
                continue
            slot, generation, size = item
            views.append(pool.view(slot)[:size])
            slots.append((slot, generation))
        return NodeRead(reply.get("lease") if reply else None, views, slots, pool)

    def still_valid(self, read: NodeRead, index: int) -> bool:
        """Whether ``read.views[index]`` still holds the leased chunk. Check after copying."""
        held = read.slots[index]
        if held is None or read.pool is None or read.pool.closed:
            return False
        return read.pool.generation(held[0]) == held[1]

    def release(self, read: NodeRead) -> None:
        """Give the pins back, with no round trip. The service also drops them if we die."""
        if read.lease is None:
            return
        with self._lock:
            if not self._peer.session_open:
                return  # the session (and with it the lease) is gone already
            try:
                self._peer.request(
                    "release", {"lease": read.lease, "ack": False}, expect_reply=False
                )
            except PeerError as exc:
                log.debug("node %s: release failed: %s", self.path, exc)

    def reserve(
        self,
        keys: Sequence[ChunkKey],
        *,
        if_absent: bool = True,
        part: RankShare | None = None,
    ) -> NodeReservation:
        """Writable slots for ``keys``. With ``if_absent``, none for keys the node holds.

        ``part`` says this process is one TP rank of an engine and writes only its heads.
        The ranks of one engine get the same slot per key. The node seals and publishes
        the chunk once every rank has committed its part.
        """
        with self._lock:
            fields: dict[str, Any] = {
                "keys": P.pack_keys(keys),
                "plane": P.PLANE_SHM,
                "mode": "if_absent" if if_absent else "overwrite",
            }
            if part is not None:
                fields.update(part.fields())
            reply = self._request("reserve", fields) if keys else None
            pool = self._pool
        items = reply.get("items") if reply is not None else None
        present = reply.get("present") if reply is not None else None
        if (
            pool is None
            or not isinstance(items, list)
            or not isinstance(present, list)
            or len(items) != len(keys)
            or len(present) != len(keys)
        ):
            return NodeReservation(None, [None] * len(keys), [False] * len(keys))
        views: list[memoryview | None] = [
            pool.view(item[0]) if _well_formed(item, 2, pool) else None for item in items
        ]
        lease = reply.get("lease") if reply and any(v is not None for v in views) else None
        return NodeReservation(lease, views, [bool(p) for p in present])

    def commit(self, reservation: NodeReservation, sizes: Sequence[int]) -> list[bool]:
        """Publish what was written: ``sizes[i]`` bytes of slot ``i``. A size of 0 gives the
        slot back. Per key: whether the node stored it. It checks every chunk first."""
        if reservation.lease is None:
            return [False] * len(sizes)
        wanted = [size if view is not None else 0 for size, view in zip(sizes, reservation.views)]
        with self._lock:
            reply = self._request("commit", {"lease": reservation.lease, "sizes": wanted})
        if reply is None:
            # Not committed (the service is marked down, or refused): give the slots back,
            # or the session would hold them as long as it lives.
            self.abort(reservation)
        stored = reply.get("stored") if reply is not None else None
        if not isinstance(stored, list) or len(stored) != len(wanted):
            return [False] * len(sizes)
        return [bool(ok) for ok in stored]

    def abort(self, reservation: NodeReservation) -> None:
        """Give every reserved slot back unpublished."""
        self.release(NodeRead(reservation.lease, [], [], None))

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Per key: whether the node held it and now does not."""
        with self._lock:
            reply = self._request("delete", {"keys": P.pack_keys(keys)}) if keys else None
        return _flags(reply, "deleted", len(keys))

    def stats(self) -> dict[str, Any]:
        """The service's counters; empty when it is down."""
        with self._lock:
            reply = self._request("stats", {})
        stats = reply.get("stats") if reply is not None else None
        return stats if isinstance(stats, dict) else {}

    def close(self) -> None:
        """Say goodbye and unmap the pool. The service releases our leases."""
        with self._lock:
            self._peer.close()
            if self._pool is not None:
                self._pool.close()
                self._pool = None


def _flags(reply: dict[str, Any] | None, field: str, count: int) -> list[bool]:
    """One flag per item from ``reply[field]``; all False when the node is down or the reply
    does not hold exactly ``count`` of them."""
    values = reply.get(field) if reply is not None else None
    if not isinstance(values, list) or len(values) != count:
        return [False] * count
    return [bool(v) for v in values]


def _well_formed(item: Any, length: int, pool: SlotPool) -> bool:
    """A reply item naming a slot of ``pool``: ``length`` non-negative ints, slot in range."""
    return (
        isinstance(item, list)
        and len(item) == length
        and all(P.is_wire_int(x) and x >= 0 for x in item)
        and item[0] < pool.num_slots
    )


__all__ = [
    "NodeClient",
    "NodeRead",
    "NodeRefused",
    "NodeReservation",
    "RankShare",
    "engine_identity",
    "node_endpoint",
]
