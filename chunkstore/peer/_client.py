"""PeerClient: one connection to one peer server, every request bounded by a timeout.

A caller making several requests as one operation bounds them together with
:meth:`PeerClient.within`. A ``PeerStore`` read is such an operation: ``hello``,
``exists``, ``fetch`` and the NIXL READ. Each request then waits only for what is
left of the operation's deadline.

The socket is a ZeroMQ DEALER. Requests carry ids and replies are matched by id.
A late reply to a timed-out request is thus recognised and dropped.
It is never taken for the answer to the next request.
The REQ/REP lock-step would wedge instead.

After a timeout the peer is marked down for ``retry_after_s``.
Further requests fail at once, so a dead or stalled peer costs one timeout, not one per request.
A network peer's socket is then replaced, since its leases are timed and outlive the connection.
A node client's socket is kept, see ``keep_session_on_timeout``.
The service ends a node session with its connection, releasing every pin and reservation.
So neither one slow request nor a full send queue may close it.
Releases that find no room in the queue wait for the next request, up to a bound.

The client is split by job. This module holds the request loop and the public operations.
``_clientconfig`` holds the settings, ``_clienthello`` the session handshake,
``_clientreplies`` the reply checks, and ``_clientnixl`` the NIXL transfers.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from chunkstore.backends.base import Buffer, ChunkInfo
from chunkstore.errors import ConfigError
from chunkstore.hashing import ChunkKey, check_namespace
from chunkstore.peer import _protocol as P
from chunkstore.peer._clientconfig import AUTO, PeerClientConfig, peer_endpoint
from chunkstore.peer._clientconfig import zmq_module as _zmq
from chunkstore.peer._clienthello import SessionOpening
from chunkstore.peer._clientnixl import NixlClientPlane, NixlTransfers
from chunkstore.peer._clientreplies import ReplyReading
from chunkstore.peer._errors import PeerRefused, PeerUnavailable, ProtocolViolation
from chunkstore.peer._metrics import PeerMetrics, default_peer_metrics

__all__ = [
    "AUTO",
    "MAX_UNSENT_RELEASES",
    "NixlClientPlane",
    "PeerClient",
    "PeerClientConfig",
    "peer_endpoint",
]

log = logging.getLogger(__name__)

MAX_UNSENT_RELEASES = 1024
"""Releases a kept session holds while the send queue has no room for them.
Each takes 16 bytes.
One more ends the session on purpose, and the service then releases all its leases."""


class PeerClient(SessionOpening, ReplyReading, NixlTransfers):
    """Requests to one peer server at ``tcp://host:port``.

    Thread-safe, one request at a time.
    One class because every part shares one socket, session and lock.
    Its jobs live in mixins: :class:`SessionOpening`, :class:`ReplyReading` and
    :class:`NixlTransfers`.
    """

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
        """Per calling thread, the monotonic deadline of the operation in progress.
        Set by ``within``."""
        self._ids = itertools.count(1)
        self._ctx = _zmq().Context.instance()
        self._socket: Any = None
        self._session: bytes | None = None
        self._unsent: list[bytes] = []
        """Lease ids of this session's releases the send queue had no room for."""
        self._down_until = 0.0
        self._closed = False
        """Set by :meth:`close`. A straggling request must not open a new session then.
        Nor may it open a NIXL plane nobody would close.
        An example is a fetch's release after its store closed."""
        self.server_info: dict[str, Any] = {}
        self.plane: str | None = None
        """The data plane in use after ``hello``: ``nixl`` or ``inline``."""
        self.plane_reason = ""
        """Why the plane was chosen, such as why NIXL is not used."""
        self._remote_agent: str | None = None
        """The server's NIXL agent as loaded into our plane's endpoint.
        It is one hold on it, which :meth:`_hold_remote` swaps and lets go."""
        self._remote_lock = threading.Lock()
        """Guards the swap of :attr:`_remote_agent` alone.
        A failed READ marks the peer down outside :attr:`_lock`.
        The same hold must never be let go twice."""
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
        """Whether a session from ``hello`` is open. If not, the next request opens one."""
        return self._session is not None

    @property
    def available(self) -> bool:
        """False while the peer is marked down after a failure."""
        return time.monotonic() >= self._down_until

    @contextmanager
    def within(self, deadline: float | None) -> Iterator[None]:
        """Bound every request this thread makes inside the block by ``deadline``.

        ``deadline`` is a ``time.monotonic()`` value, and ``None`` adds no bound.
        ``timeout_s`` still bounds each request.
        A request that would start with no time left raises ``PeerUnavailable`` unsent.
        It does not mark the peer down, since the peer was not asked.
        """
        outer = getattr(self._bound, "at", None)
        self._bound.at = deadline
        try:
            yield
        finally:
            self._bound.at = outer

    def _request_deadline(self, started: float, op: str, expect_reply: bool) -> float:
        """Return when a request started at ``started`` must have its reply.

        That is ``timeout_s`` later, or the operation's deadline from :meth:`within` if sooner.
        """
        deadline = started + self.config.timeout_s
        bound: float | None = getattr(self._bound, "at", None)
        if bound is None:
            return deadline
        if expect_reply and bound <= started:
            raise PeerUnavailable(f"{self.endpoint}: no time left for {op} in this call")
        return min(deadline, bound)

    def _mark_down(self, reason: str, *, keep_session: bool = False) -> None:
        """Count the peer down for ``retry_after_s``.

        With ``keep_session`` the connection and the session stay.
        See :attr:`PeerClientConfig.keep_session_on_timeout`.
        """
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
        """Make ``name`` the server's agent we use, letting go of the one held before.

        ``name`` is an agent :meth:`NixlEndpoint.add_remote` just loaded for us, or ``None``.
        The shared endpoint counts agents per user, so each hold is let go exactly once.
        """
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
        """Send one request and wait for its reply, at most ``timeout_s``.

        Raises :class:`PeerUnavailable` on timeout or while the peer is marked down.
        Raises :class:`PeerRefused` on an error reply.
        A message without reply, a ``release``, is still sent while down if the session was kept.
        It costs no wait, and the lease it ends would otherwise last as long as the session.
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
        """Release the lease a late reply granted.

        The reply answers a timed-out ``fetch`` or ``reserve``.
        Nobody uses that lease, and a node holds it until released.
        """
        lease = reply.get("lease")
        if not (authentic and reply.get("ok") is True and isinstance(lease, bytes)):
            return
        if self._session is None or self._socket is None:
            return
        if not self._send_release(lease):
            self._keep_unsent(lease)

    def _send_release(self, lease: bytes) -> bool:
        """Queue a release without ``ack``, so without reply. False if the queue has no room."""
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
        """Send the releases that found no room before, oldest first, while room lasts."""
        while self._unsent and self._send_release(self._unsent[0]):
            self._unsent.pop(0)

    def _keep_unsent(self, lease: bytes) -> None:
        """Keep a release for the next request.

        Past :data:`MAX_UNSENT_RELEASES` it ends the session instead.
        The service then releases every lease of the session with the connection.
        """
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

    def hello(self) -> dict[str, Any]:
        """Open a session now instead of lazily. Returns the server's hello reply."""
        with self._lock:
            if self._closed:
                raise PeerUnavailable(f"{self.endpoint}: the client is closed")
            if not self.available:
                raise PeerUnavailable(f"{self.endpoint} is marked down after a failure")
            if self._session is None:
                self._hello()
            return self.server_info

    # --- operations ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """Return how many leading keys of a chain the peer holds.

        It takes one round trip per 4096 keys.
        """
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
        """Return the raw chunk bytes per key, ``None`` where the peer has none.

        The bytes are not verified: the caller checks each chunk, as
        :meth:`PeerStore.get_many` does.
        ``use=False`` is a maintenance read. The server then neither pins the chunks
        nor records an access.
        """
        self.hello()
        out: list[bytes | None] = []
        for batch in self._batches(keys):
            if self.plane == P.PLANE_NIXL:
                out.extend(self._fetch_nixl(batch, None, use=use))
            else:
                out.extend(self._fetch_inline(batch, use=use))
        return out

    def fetch_into(self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]) -> list[int | None]:
        """Fetch chunks straight into caller buffers. Returns the size per key, or ``None``.

        Over NIXL a buffer in memory registered with :meth:`register_memory` gets no copy.
        """
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

    def push(
        self, items: Sequence[tuple[ChunkKey, Buffer]], *, overwrite: bool = False
    ) -> list[bool]:
        """Offer chunks to the peer. Returns True per chunk the peer holds afterwards."""
        return [stored for stored, _ in self.push_detailed(items, overwrite=overwrite)]

    def push_detailed(
        self, items: Sequence[tuple[ChunkKey, Buffer]], *, overwrite: bool = False
    ) -> list[tuple[bool, bool]]:
        """Offer chunks to the peer.

        Returns per chunk whether the peer holds it now, and whether this push wrote it.
        """
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

    def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Delete keys on the peer. Returns True per key that was there."""
        self.hello()
        out: list[bool] = []
        for batch in self._batches(keys):
            reply, _ = self.request("delete", {"keys": P.pack_keys(batch)})
            out.extend(bool(d) for d in self._per_key(reply, "deleted", len(batch)))
        return out

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        """Yield every chunk the peer holds, or those of one namespace, page by page."""
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

    def stats(self) -> dict[str, Any]:
        """The server's counters and state."""
        reply, _ = self.request("stats", {})
        stats = reply.get("stats")
        if not isinstance(stats, dict):
            raise self._malformed("stats")
        return stats

    def close(self) -> None:
        """Say goodbye, best effort, and release the socket and NIXL state.

        Later requests raise :class:`PeerUnavailable`.
        """
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
