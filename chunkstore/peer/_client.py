"""PeerClient: one connection to one peer server, every request bounded by a timeout.

A caller making several requests as one operation (a ``PeerStore`` read: ``hello``,
``exists``, ``fetch``, the NIXL READ) bounds them together with :meth:`PeerClient.within`:
each request then waits only for what is left of the operation's deadline.

The socket is a ZeroMQ DEALER: requests carry ids and replies are matched by
id, so a late reply to a timed-out request is recognised and dropped instead of
being taken for the answer to the next one (the REQ/REP lock-step would wedge
instead). After a timeout the peer is marked down for ``retry_after_s``:
further requests fail at once, so a dead or stalled peer costs one timeout, not
one per request. A network peer's socket is replaced then (its leases are
timed and outlive the connection); a node client's is kept
(``keep_session_on_timeout``): the service ends a node session, releasing every
pin and reservation, when its connection closes, so one slow request must not
close it, nor a send queue that a stalled service left full (the releases that
found no room wait, a bounded number, for the next request).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import socket as _socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from chunkstore.backends.base import Buffer, ChunkInfo
from chunkstore.errors import ConfigError, MissingDependency
from chunkstore.hashing import ChunkKey, check_namespace
from chunkstore.peer import _protocol as P
from chunkstore.peer._arena import Allocation, Arena
from chunkstore.peer._errors import PeerRefused, PeerUnavailable, ProtocolViolation
from chunkstore.peer._metrics import PeerMetrics, default_peer_metrics
from chunkstore.peer._nixlplane import NixlEndpoint, address_of, nixl_unavailable_reason

log = logging.getLogger(__name__)

MAX_UNSENT_RELEASES = 1024
"""Releases a kept session holds while the send queue has no room for them (16 bytes each).
One more ends the session on purpose: the service then releases every lease of it."""

AUTO = "auto"

_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s;/\[\]]+):([0-9]{1,5})")


def peer_endpoint(text: str) -> str:
    """``host:port``, ``tcp://host:port`` or ``ipc:///path`` as the ZeroMQ endpoint to connect
    to; ConfigError naming ``text`` when it is none of these (ZeroMQ would refuse it with an
    exception on every connect, or read ``a;b`` as a source and a destination)."""
    endpoint = text if text.startswith(("tcp://", "ipc://")) else f"tcp://{text}"
    if endpoint.startswith("ipc://"):
        if len(endpoint) > len("ipc://") and not any(c.isspace() for c in endpoint):
            return endpoint
    else:
        match = _TCP_ENDPOINT.fullmatch(endpoint)
        if match is not None and 1 <= int(match.group(2)) <= 65535:
            return endpoint
    raise ConfigError(
        f"peer endpoint {text!r} is not host:port, tcp://host:port (port 1..65535) or ipc:///path"
    )


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise MissingDependency(
            "the peer store needs pyzmq and msgpack: pip install 'chunkstore[peer]'"
        ) from None
    return zmq


@dataclass(frozen=True, slots=True)
class PeerClientConfig:
    """How a client talks to peers."""

    fingerprint: bytes | None = None
    """Our model fingerprint; a peer serving another one refuses us. ``None``: don't check."""
    chunk_tokens: int | None = None
    """Our tokens per chunk; checked like the fingerprint."""
    secret: bytes | str | None = None
    """Shared secret for message authentication (default: $CHUNKSTORE_PEER_SECRET)."""
    use_env_secret: bool = True
    """Whether an unset ``secret`` falls back to $CHUNKSTORE_PEER_SECRET."""
    curve_server_key: bytes | None = None
    """Z85 CURVE public key of the server; enables encryption (the server must use CURVE)."""
    curve_public_key: bytes | None = None
    """Our Z85 CURVE public key (a fresh key pair is made when unset)."""
    curve_secret_key: bytes | None = None
    """Our Z85 CURVE secret key."""
    plane: str = AUTO
    """Data plane: ``auto`` (NIXL when both sides have it, else inline), ``nixl``, ``inline``,
    or ``shm`` (a node service's shared slot pool; see :class:`chunkstore.node.NodeClient`)."""
    slot_size: int | None = None
    """Our chunk size in bytes, sent in ``hello`` for the ``shm`` plane: a node whose pool
    slots differ refuses us (``geometry_mismatch``). ``None``: not sent."""
    timeout_s: float = 2.0
    """Bound on every request, NIXL transfer included: past it the request is a miss. A
    ``PeerStore`` call is bounded by it in total, however many requests it makes."""
    retry_after_s: float = 2.0
    """After a timeout the peer counts as down this long (requests fail immediately)."""
    lease_ms: int = 5_000
    """Lease asked for on NIXL fetches."""
    recv_arena_bytes: int = 64 << 20
    """NIXL receive/send arena; larger batches are read and pushed in rounds that fit it. A
    single chunk larger than the arena cannot cross NIXL: a miss, or not pushed."""
    client_name: str | None = None
    """How we introduce ourselves (default host:pid)."""
    immediate: bool = False
    """Queue requests only on a live connection (ZMQ_IMMEDIATE): a request to a server whose
    connection closed fails at once instead of after ``timeout_s`` (``hello`` waits up to
    ``timeout_s`` for the connection). For a node service on a unix socket, whose death
    the kernel reports at once."""
    keep_session_on_timeout: bool = False
    """After a request times out, keep the connection and the session instead of replacing
    them (the peer is still marked down). For a node service, which ends a session with
    its connection: closing it would release every pin and reservation the client still
    uses. A late reply that grants a lease has that lease given back."""
    limits: P.Limits = field(default_factory=P.Limits)
    """Limits on replies we accept."""


class NixlClientPlane:
    """A client's NIXL agent plus its registered receive/send arena, shared by its connections."""

    def __init__(self, arena_bytes: int) -> None:
        self.endpoint = NixlEndpoint("client")
        self.arena = Arena(arena_bytes)
        self.endpoint.register(self.arena.array)

    def close(self) -> None:
        """Deregister and drop the agent."""
        self.endpoint.close()


class PeerClient:
    """Requests to one peer server (``tcp://host:port``). Thread-safe; one request at a time."""

    def __init__(
        self,
        endpoint: str,
        config: PeerClientConfig | None = None,
        nixl: NixlClientPlane | None = None,
        *,
        metrics: PeerMetrics | None = None,
        **overrides: Any,
    ) -> None:
        self.config = replace(config or PeerClientConfig(), **overrides)
        self.metrics = metrics or default_peer_metrics()
        """Where this client's ``chunkstore_peer_client_*`` metrics go."""
        if self.config.plane not in (AUTO, *P.PLANES):
            raise ConfigError(
                f"unknown data plane {self.config.plane!r}; use auto, nixl, inline or shm"
            )
        self.endpoint = peer_endpoint(endpoint)
        self.codec = P.Codec(
            P.secret_from(self.config.secret, use_env=self.config.use_env_secret),
            self.config.limits,
        )
        self._nixl = nixl
        self._own_nixl = False
        self._lock = threading.RLock()
        self._bound = threading.local()
        """Per calling thread: the monotonic deadline of the operation in progress (``within``)."""
        self._ids = itertools.count(1)
        self._ctx = _zmq().Context.instance()
        self._socket: Any = None
        self._session: bytes | None = None
        self._unsent: list[bytes] = []
        """Lease ids of this session's releases the send queue had no room for."""
        self._down_until = 0.0
        self._closed = False
        """Set by :meth:`close`: a straggling request (a fetch's release after its store
        closed) must not open a new session, nor a new NIXL plane nobody would close."""
        self.server_info: dict[str, Any] = {}
        self.plane: str | None = None
        """The data plane in use after ``hello`` (``nixl`` or ``inline``)."""
        self.plane_reason = ""
        """Why the plane was chosen (e.g. why NIXL is not used)."""
        self._remote_agent: str | None = None
        """The server's NIXL agent as loaded into our plane's endpoint: one hold on it,
        which :meth:`_hold_remote` swaps and lets go."""
        self._remote_lock = threading.Lock()
        """Guards the swap of :attr:`_remote_agent` alone: a failed READ marks the peer down
        outside :attr:`_lock`, and the same hold must never be let go twice."""
        self._curve: tuple[bytes, bytes] | None = None
        if self.config.curve_server_key is not None:
            if self.config.curve_public_key and self.config.curve_secret_key:
                self._curve = (self.config.curve_public_key, self.config.curve_secret_key)
            else:
                self._curve = _zmq().curve_keypair()

    # --- plumbing ----------------------------------------------------------------------

    def _connect(self) -> Any:
        zmq = _zmq()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_frame_bytes)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SNDHWM, 1000)
        if self.config.immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.endpoint.startswith("tcp://["):
            # Only for an IPv6 address: with the option a host name may resolve to IPv6 only.
            sock.setsockopt(zmq.IPV6, 1)
        if self._curve is not None:
            sock.curve_serverkey = self.config.curve_server_key
            sock.curve_publickey, sock.curve_secretkey = self._curve
        sock.connect(self.endpoint)
        return sock

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    @property
    def session_open(self) -> bool:
        """Whether a session from ``hello`` is open (it is opened on the next request if not)."""
        return self._session is not None

    @property
    def available(self) -> bool:
        """False while the peer is marked down after a failure."""
        return time.monotonic() >= self._down_until

    @contextmanager
    def within(self, deadline: float | None) -> Iterator[None]:
        """Bound every request this thread makes inside the block by ``deadline`` (a
        ``time.monotonic()`` value) as well as by ``timeout_s``; ``None``: no extra bound.

        A request that would start with no time left fails at once (``PeerUnavailable``)
        without being sent, and without marking the peer down: the peer was not asked."""
        outer = getattr(self._bound, "at", None)
        self._bound.at = deadline
        try:
            yield
        finally:
            self._bound.at = outer

    def _request_deadline(self, started: float, op: str, expect_reply: bool) -> float:
        """When a request started at ``started`` must have its reply: ``timeout_s`` later, or
        the deadline of the operation it belongs to (:meth:`within`) if that comes first."""
        deadline = started + self.config.timeout_s
        bound: float | None = getattr(self._bound, "at", None)
        if bound is None:
            return deadline
        if expect_reply and bound <= started:
            raise PeerUnavailable(f"{self.endpoint}: no time left for {op} in this call")
        return min(deadline, bound)

    def _mark_down(self, reason: str, *, keep_session: bool = False) -> None:
        """Count the peer down for ``retry_after_s``; ``keep_session``: the connection and
        the session stay (see :attr:`PeerClientConfig.keep_session_on_timeout`)."""
        self._down_until = time.monotonic() + self.config.retry_after_s
        self.metrics.client_failures.labels(reason).inc()
        if keep_session:
            return
        self._unsent.clear()  # the session ends with the connection: its leases with it
        self._reset()
        # The peer may have restarted (a new agent, loaded by the next hello) or its
        # connection broken: let go of our hold on its agent. Only our hold: another client
        # sharing the plane may still read from the same agent, which goes with its last user.
        self._hold_remote(None)
        self._session = None

    def _hold_remote(self, name: str | None) -> None:
        """Make ``name`` (an agent :meth:`NixlEndpoint.add_remote` just loaded for us, or
        ``None``) the server's agent we use, letting go of the one held before. Agents are
        counted per user in the shared endpoint, so each hold is let go exactly once."""
        with self._remote_lock:
            held, self._remote_agent = self._remote_agent, name
        if held is not None and self._nixl is not None:
            self._nixl.endpoint.remove_remote(held)

    def request(
        self,
        op: str,
        fields: dict[str, Any],
        data: Sequence[Any] = (),
        *,
        expect_reply: bool = True,
    ) -> tuple[dict[str, Any], list[Any]]:
        """Send one request and wait for its reply (bounded by ``timeout_s``).

        Raises :class:`PeerUnavailable` on timeout or while the peer is marked
        down, :class:`PeerRefused` on an error reply. A message without reply (a
        ``release``) is still sent while down when the session was kept: it costs no
        wait, and the lease it ends would otherwise be held until the session ends.
        """
        with self._lock:
            if self._closed:
                raise PeerUnavailable(f"{self.endpoint}: the client is closed")
            kept = self._session is not None and self._socket is not None
            if not self.available and (expect_reply or not kept):
                raise PeerUnavailable(f"{self.endpoint} is marked down after a failure")
            if op != "hello" and self._session is None:
                self._hello()
            try:
                return self._exchange(op, fields, data, expect_reply)
            except PeerRefused as exc:
                if exc.code != P.NO_SESSION or op == "hello":
                    raise
            self._session = None  # the server restarted or expired us: one fresh hello, one retry
            self._hello()
            return self._exchange(op, fields, data, expect_reply)

    def _exchange(
        self, op: str, fields: dict[str, Any], data: Sequence[Any], expect_reply: bool
    ) -> tuple[dict[str, Any], list[Any]]:
        zmq = _zmq()
        if self._socket is None:
            self._socket = self._connect()
        request_id = next(self._ids)
        body = {"v": P.PROTOCOL_VERSION, "op": op, "id": request_id, **fields}
        if op != "hello":
            body["s"] = self._session
        frames = self.codec.encode(body, data, reply=False)
        started = time.monotonic()
        deadline = self._request_deadline(started, op, expect_reply)
        if self.config.immediate and op == "hello":
            # A fresh socket: wait (bounded) until the connection is up before the hello.
            if not self._socket.poll(int((deadline - started) * 1000) + 1, zmq.POLLOUT):
                self._mark_down("timeout")
                raise PeerUnavailable(f"{self.endpoint} accepts no connection")
        if op != "hello":
            self._send_unsent()
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if self.config.keep_session_on_timeout and op != "hello":
                # Not connected (nothing is queued on a dead connection, and the service
                # ends the session itself) or a full queue (the service reads slowly): the
                # connection and the session stay, as after a timeout (spec §7).
                self._mark_down("not_sent", keep_session=True)
                if op == "release":
                    self._keep_unsent(fields["lease"])
                raise PeerUnavailable(
                    f"{self.endpoint}: not connected or send queue full"
                ) from None
            reason = "disconnected" if self.config.immediate else "timeout"
            self._mark_down(reason)
            raise PeerUnavailable(f"{self.endpoint}: not connected or send queue full") from None
        if not expect_reply:
            return {}, []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._socket.poll(int(remaining * 1000) + 1):
                if time.monotonic() < deadline:
                    continue
                if deadline - started < self.config.timeout_s / 2:
                    # Cut short by the call's deadline (within), which other requests (to this
                    # peer or, in parallel, to others) used up: a miss, but this peer had too
                    # little time to be judged, so it is not marked down.
                    raise PeerUnavailable(
                        f"{self.endpoint}: {op} ran out of the call's time "
                        f"({deadline - started:.3g} s left of {self.config.timeout_s:g} s)"
                    )
                # A hello that timed out opened no session we know of: nothing to keep.
                keep = self.config.keep_session_on_timeout and op != "hello"
                self._mark_down("timeout", keep_session=keep)
                raise PeerUnavailable(
                    f"{self.endpoint} did not answer {op} within {deadline - started:.3g} s"
                )
            reply_frames = self._socket.recv_multipart(copy=False)
            try:
                reply, reply_data, authentic = self.codec.decode(reply_frames, reply=True)
            except ProtocolViolation as exc:
                self._mark_down("malformed_reply")
                raise PeerUnavailable(f"{self.endpoint} sent an invalid reply: {exc}") from None
            if reply.get("id") != request_id:
                if reply.get("id") == 0 and reply.get("ok") is False:
                    # Errors about messages the server could not parse carry no id: ours.
                    pass
                else:
                    self._give_back_late_lease(reply, authentic)
                    if self._socket is None:
                        # Its release was one past the bound: the session was ended on
                        # purpose, and the reply this request waits for went with the socket.
                        raise PeerUnavailable(
                            f"{self.endpoint}: session ended over releases it could not send"
                        )
                    continue  # a late reply to an earlier, timed-out request
            self.metrics.client_seconds.labels(op, self.plane or "-").observe(
                time.monotonic() - started
            )
            if reply.get("ok") is not True or not authentic:
                code = str(reply.get("error", P.AUTH_FAILED))
                reason = str(reply.get("reason", "reply failed authentication"))
                if reply.get("ok") is True:  # a success without a valid tag is never believed
                    code, reason = P.AUTH_FAILED, "the reply failed authentication (wrong secret?)"
                self.metrics.client_failures.labels("refused").inc()
                raise PeerRefused(code, reason)
            return reply, reply_data

    def _give_back_late_lease(self, reply: dict[str, Any], authentic: bool) -> None:
        """Release the lease a late reply granted (a timed-out ``fetch`` or ``reserve`` the
        server answered after all): nobody uses it, and a node holds it until released."""
        lease = reply.get("lease")
        if not (authentic and reply.get("ok") is True and isinstance(lease, bytes)):
            return
        if self._session is None or self._socket is None:
            return
        if not self._send_release(lease):
            self._keep_unsent(lease)

    def _send_release(self, lease: bytes) -> bool:
        """Queue a release without ``ack`` (no reply); False when the queue has no room."""
        body = {"v": P.PROTOCOL_VERSION, "op": "release", "id": next(self._ids)}
        body.update(s=self._session, lease=lease, ack=False)
        try:
            self._socket.send_multipart(
                self.codec.encode(body, (), reply=False), _zmq().NOBLOCK, copy=False
            )
        except _zmq().Again:
            return False
        return True

    def _send_unsent(self) -> None:
        """Send the releases that found no room before, oldest first, while there is room."""
        while self._unsent and self._send_release(self._unsent[0]):
            self._unsent.pop(0)

    def _keep_unsent(self, lease: bytes) -> None:
        """Keep a release for the next request; past :data:`MAX_UNSENT_RELEASES`, end the
        session instead (the service releases every lease of it with the connection)."""
        if len(self._unsent) < MAX_UNSENT_RELEASES:
            self._unsent.append(lease)
            return
        log.warning(
            "peer %s: the service has read nothing for a long time and %d releases wait to "
            "be sent; ending its session so that it releases them (loads still copying are "
            "recomputed)",
            self.endpoint,
            len(self._unsent) + 1,
        )
        self._mark_down("unsent_releases")

    # --- hello ----------------------------------------------------------------------------

    def _planes_wanted(self) -> tuple[list[str], str]:
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

    def hello(self) -> dict[str, Any]:
        """Open a session now (it is opened lazily otherwise); returns the server's hello reply."""
        with self._lock:
            if self._closed:
                raise PeerUnavailable(f"{self.endpoint}: the client is closed")
            if not self.available:
                raise PeerUnavailable(f"{self.endpoint} is marked down after a failure")
            if self._session is None:
                self._hello()
            return self.server_info

    # --- operations ---------------------------------------------------------------------

    def _batches(self, keys: Sequence[ChunkKey]) -> Iterator[Sequence[ChunkKey]]:
        step = min(
            self.config.limits.max_keys,
            int(self.server_info.get("limits", {}).get("max_keys", self.config.limits.max_keys)),
        )
        for i in range(0, len(keys), step):
            yield keys[i : i + step]

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys of a chain the peer holds (one round trip per 4096 keys)."""
        total = 0
        self.hello()
        for batch in self._batches(keys):
            reply, _ = self.request("lookup", {"keys": P.pack_keys(batch)})
            prefix = reply.get("prefix")
            if not (P.is_wire_int(prefix) and 0 <= prefix <= len(batch)):
                raise self._malformed("lookup")
            total += prefix
            if prefix < len(batch):
                break
        return total

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key on the peer."""
        out: list[bool] = []
        self.hello()
        for batch in self._batches(keys):
            reply, _ = self.request("exists", {"keys": P.pack_keys(batch)})
            out.extend(bool(p) for p in self._per_key(reply, "present", len(batch)))
        return out

    def fetch(self, keys: Sequence[ChunkKey], *, use: bool = True) -> list[bytes | None]:
        """Raw chunk bytes per key (``None`` where the peer has none). Not verified: the
        caller checks each chunk (:meth:`PeerStore.get_many` does). ``use=False`` is a
        maintenance read: the server neither pins the chunks nor records an access."""
        self.hello()
        out: list[bytes | None] = []
        for batch in self._batches(keys):
            if self.plane == P.PLANE_NIXL:
                out.extend(self._fetch_nixl(batch, None, use=use))
            else:
                out.extend(self._fetch_inline(batch, use=use))
        return out

    def fetch_into(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> list[int | None]:
        """Fetch chunks straight into caller buffers; size per key or ``None``. Over NIXL a
        buffer inside memory registered with :meth:`register_memory` is written without a copy."""
        self.hello()
        if self.plane == P.PLANE_NIXL:
            results = self._fetch_nixl(keys, buffers)
            return list(results)
        sizes: list[int | None] = []
        for blob, buffer in zip(self._fetch_inline(keys, views=True), buffers):
            target = memoryview(buffer).cast("B")
            if blob is None or len(blob) > len(target):
                sizes.append(None)
                continue
            target[: len(blob)] = blob
            sizes.append(len(blob))
        return sizes

    def _fetch_inline(
        self, keys: Sequence[ChunkKey], *, views: bool = False, use: bool = True
    ) -> list[Any]:
        """``views``: return the received frames' memory (no copy) instead of ``bytes``."""
        body: dict[str, Any] = {"keys": P.pack_keys(keys), "plane": P.PLANE_INLINE, "lease_ms": 0}
        if not use:
            body["use"] = False
        reply, data = self.request("fetch", body)
        sizes = reply.get("sizes")
        if (
            not isinstance(sizes, list)
            or len(sizes) != len(keys)
            or sum(1 for s in sizes if s is not None) != len(data)
        ):
            raise self._malformed("fetch")
        out: list[bytes | None] = []
        frames = iter(data)
        total = 0
        for size in sizes:
            if size is None:
                out.append(None)
                continue
            frame = next(frames)
            if hasattr(frame, "buffer"):
                blob = frame.buffer if views else frame.bytes
            else:
                blob = frame if views else bytes(frame)
            if len(blob) != size:
                raise PeerUnavailable(f"{self.endpoint}: a data frame has the wrong size")
            total += size
            out.append(blob)
        self.metrics.client_bytes.labels(P.PLANE_INLINE, "in").inc(total)
        return out

    def _fetch_nixl(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer] | None, *, use: bool = True
    ) -> list[Any]:
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

    def push(
        self, items: Sequence[tuple[ChunkKey, Buffer]], *, overwrite: bool = False
    ) -> list[bool]:
        """Offer chunks to the peer; True per chunk the peer holds afterwards."""
        return [stored for stored, _ in self.push_detailed(items, overwrite=overwrite)]

    def push_detailed(
        self, items: Sequence[tuple[ChunkKey, Buffer]], *, overwrite: bool = False
    ) -> list[tuple[bool, bool]]:
        """Offer chunks to the peer; per chunk (the peer holds it now, this push wrote it)."""
        self.hello()
        if self.server_info.get("read_only"):
            raise PeerRefused(P.READ_ONLY, f"{self.endpoint} does not accept pushed chunks")
        out: list[tuple[bool, bool]] = []
        mode = "overwrite" if overwrite else "if_absent"
        step = min(self.config.limits.max_keys, 256)
        for i in range(0, len(items), step):
            batch = items[i : i + step]
            keys = [k for k, _ in batch]
            views = [memoryview(b).cast("B") for _, b in batch]
            if self.plane == P.PLANE_NIXL:
                out.extend(self._push_nixl(keys, views, mode))
                continue
            fields: dict[str, Any] = {
                "keys": P.pack_keys(keys),
                "sizes": [len(v) for v in views],
                "mode": mode,
            }
            reply, _ = self.request("push", {**fields, "plane": P.PLANE_INLINE, "addrs": []}, views)
            self.metrics.client_bytes.labels(P.PLANE_INLINE, "out").inc(sum(len(v) for v in views))
            out.extend(self._stored(reply, len(batch)))
        return out

    def _push_nixl(
        self, keys: Sequence[ChunkKey], views: list[memoryview], mode: str
    ) -> list[tuple[bool, bool]]:
        """Push over NIXL in as many requests as the send arena needs: each request's chunks
        are staged in the arena at once (the server READs them while it answers)."""
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

    def _stored(self, reply: dict[str, Any], n: int) -> list[tuple[bool, bool]]:
        stored, written = self._per_key(reply, "stored", n), self._per_key(reply, "written", n)
        return [(bool(s), bool(w)) for s, w in zip(stored, written)]

    def _per_key(self, reply: dict[str, Any], name: str, n: int) -> list[Any]:
        """Reply field ``name``: a list of one entry per key asked about (``n``)."""
        value = reply.get(name)
        if not isinstance(value, list) or len(value) != n:
            raise self._malformed(f"{name!r} of the")
        return value

    def _malformed(self, what: str) -> PeerUnavailable:
        """The failure for a reply that breaks spec/PROTOCOL.md §4 (a buggy or hostile peer):
        the request fails like an unreachable peer's, never with another exception."""
        self.metrics.client_failures.labels("malformed_reply").inc()
        return PeerUnavailable(f"{self.endpoint}: malformed {what} reply")

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete keys on the peer; True per key that was there."""
        self.hello()
        out: list[bool] = []
        for batch in self._batches(keys):
            reply, _ = self.request("delete", {"keys": P.pack_keys(batch)})
            out.extend(bool(d) for d in self._per_key(reply, "deleted", len(batch)))
        return out

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        """Every chunk the peer holds (of one namespace), page by page."""
        if namespace is not None:
            check_namespace(namespace)
        after: bytes | None = None
        while True:
            reply, _ = self.request("list", {"namespace": namespace, "after": after, "limit": 1024})
            entries = reply.get("entries") or []
            if not isinstance(entries, list):
                raise PeerUnavailable(f"{self.endpoint}: list reply is not a list of entries")
            for entry in entries:
                yield self._listed(entry)
            if not reply.get("more") or not entries:
                return
            after = entries[-1][0]

    def _listed(self, entry: Any) -> ChunkInfo:
        """One ``list`` entry ``[wire key, size, mtime, atime]``, checked like a request field."""
        try:
            wire, size, mtime, atime = entry
            (key,) = P.unpack_keys(wire, self.config.limits)
            if not P.is_wire_int(size) or size < 0:
                raise ValueError("size")
            return ChunkInfo(key, size, float(mtime), float(atime))
        except (ValueError, TypeError, ProtocolViolation):
            raise PeerUnavailable(f"{self.endpoint}: malformed list entry") from None

    def stats(self) -> dict[str, Any]:
        """The server's counters and state."""
        reply, _ = self.request("stats", {})
        stats = reply.get("stats")
        if not isinstance(stats, dict):
            raise self._malformed("stats")
        return stats

    def close(self) -> None:
        """Say goodbye (best effort) and release the socket and NIXL state; later requests
        raise :class:`PeerUnavailable`."""
        with self._lock:
            self._closed = True
            if self._session is not None and self._socket is not None and self.available:
                try:
                    self._exchange("bye", {}, (), True)  # wait: the server unpins our leases first
                except Exception:  # noqa: BLE001 - the server cleans up idle sessions anyway
                    pass
            self._session = None
            self._reset()
            self._hold_remote(None)
            if self._own_nixl and self._nixl is not None:
                self._nixl.close()
                self._nixl = None
