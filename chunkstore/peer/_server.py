"""PeerServer: exposes a store to other instances, be it a host cache, a tiered store or any.

One I/O thread owns the ZeroMQ ROUTER socket.
It receives, and checks size, framing, version and MAC.
It hands valid requests to a small worker pool, since store calls may block on disk.
Workers queue their replies and wake the I/O thread through a pipe.
Only the I/O thread ever touches the socket, as ZeroMQ requires.
The same loop expires leases and idle sessions.
So a dead client cannot pin memory beyond its lease.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from chunkstore.backends.base import Store
from chunkstore.errors import ConfigError, MissingDependency
from chunkstore.peer import _protocol as P
from chunkstore.peer._accounting import ClientSeries, ServerAccounting
from chunkstore.peer._discovery import PeerInfo
from chunkstore.peer._errors import ProtocolViolation
from chunkstore.peer._handlers import RequestHandlers, SlotPlane, push_check
from chunkstore.peer._localsocket import BoundSocket, bind_owner_only
from chunkstore.peer._metrics import PeerMetrics, default_peer_metrics
from chunkstore.peer._serverconfig import PeerServerConfig, check_server_config, is_local
from chunkstore.peer._sessions import Session, SessionTable
from chunkstore.peer._staging import NixlStaging

log = logging.getLogger(__name__)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise MissingDependency(
            "the peer server needs pyzmq and msgpack: pip install 'chunkstore[peer]'"
        ) from None
    return zmq


def capacity_of(store: Any) -> tuple[int, int] | None:
    """(capacity, used) bytes when the object reports them, else None.
    HostCache and TieredStore report them."""
    capacity = getattr(store, "capacity_bytes", None)
    if capacity is None and hasattr(store, "host"):
        capacity = getattr(store.host, "capacity_bytes", None)
    if not isinstance(capacity, int):
        return None
    used = getattr(store, "used_bytes", None)
    if not isinstance(used, int):
        stats = getattr(store, "stats", None)
        snapshot = stats() if callable(stats) else None
        used = getattr(snapshot, "bytes_used", None)
        if used is None:
            used = getattr(getattr(snapshot, "host", None), "bytes_used", None)
    if not isinstance(used, int):
        return None
    return capacity, used


def _source_address(frame: Any) -> str:
    """The sender's address as ZeroMQ reports it ("" where the transport has none)."""
    try:
        return str(frame.get("Peer-Address"))
    except Exception:  # noqa: BLE001 - not every transport or libzmq exposes it
        return ""


class PeerServer:
    """Serves ``store`` over the peer protocol of spec/PROTOCOL.md until :meth:`stop`.

    One class because the I/O thread owns the socket, its poller and the reply queue.
    Sessions, handlers, staging and accounting already live in modules of their own.
    """

    def __init__(
        self,
        store: Store,
        config: PeerServerConfig | None = None,
        *,
        metrics: PeerMetrics | None = None,
        **overrides: Any,
    ) -> None:
        config = replace(config or PeerServerConfig(), **overrides)
        check_server_config(config)
        self.store = store
        self.config = config
        self._secret = P.secret_from(config.secret, use_env=config.use_env_secret)
        self.codec = P.Codec(self._secret, config.limits)
        self.metrics = metrics or default_peer_metrics()
        """Where the ``chunkstore_peer_server_*`` metrics go (labelled by :attr:`name`)."""
        self._accounting = ServerAccounting(
            self.metrics, lambda: self.name, client_series=self._client_series()
        )
        self._valid = push_check(config, self._accounting, lambda: self.name)
        """The check of every chunk a client sends (push, commit)."""
        self._sessions = SessionTable(config, self._accounting, self._forget)
        self._handlers: RequestHandlers | None = None
        # Replies for the I/O thread: (frames, on_sent, on_dropped); see _queue_reply.
        self._outbox: queue.SimpleQueue[
            tuple[list[Any], Callable[[], None] | None, Callable[[], None] | None]
        ] = queue.SimpleQueue()
        # Replies whose data frames are pinned chunks ZeroMQ still sends from (zero copy):
        # (tracker, unpin, pins, deadline). See _sweep for the deadline.
        self._tracked: list[tuple[Any, Callable[[], None], int, float]] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._staging: NixlStaging | None = None
        self._shm: SlotPlane | None = None
        self._local = is_local(config)
        self._bound: BoundSocket | None = None
        self._monitor: Any = None
        self._auth: Any = None
        self._ctx: Any = None
        self._wake_r = self._wake_w = -1
        self.nixl_reason: str | None = None
        self.shm_reason: str | None = None
        """Why the ``shm`` plane is not offered (``None`` when it is, or was not asked for)."""
        self.planes: tuple[str, ...] = ()
        self.endpoint = ""
        self.started_at = 0.0
        self._on_io_thread = (
            config.handle_on_io_thread
            if config.handle_on_io_thread is not None
            else getattr(store, "kind", "") in ("memory", "host")
        )

    # --- lifecycle ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The server's name (config, else its endpoint)."""
        return self.config.name or self.endpoint.removeprefix("tcp://")

    def start(self) -> PeerServer:
        """Bind, and start NIXL when offered and available, then the I/O thread. Returns self."""
        zmq = _zmq()
        self._setup_planes()
        self._handlers = RequestHandlers(
            self.store,
            self.config,
            sessions=self._sessions,
            accounting=self._accounting,
            staging=self._staging,
            planes=self.planes,
            nixl_reason=self.nixl_reason,
            name=lambda: self.name,
            stats=self.stats,
            valid=self._valid,
            shm=self._shm,
        )
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="peer-worker")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="peer-server-io", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self.stop()
            raise self._start_error
        self.started_at = time.time()
        log.info(
            "peer server %s listening on %s (planes: %s%s)",
            self.name,
            self.endpoint,
            ", ".join(self.planes),
            f"; nixl off: {self.nixl_reason}" if self.nixl_reason else "",
        )
        return self

    def _setup_planes(self) -> None:
        """Open each data plane asked for. One that cannot start is dropped, with its reason."""
        planes = tuple(self.config.planes)
        if P.PLANE_SHM in planes:
            self._shm, self.shm_reason = self._open_slot_plane()
            planes = tuple(p for p in planes if p != P.PLANE_SHM or self._shm is not None)
        if P.PLANE_NIXL in planes:
            self._staging, self.nixl_reason = NixlStaging.open(
                self.store, self.config.staging_bytes
            )
            planes = tuple(p for p in planes if p != P.PLANE_NIXL or self._staging is not None)
        self.planes = planes
        if not self.planes:
            reasons = "; ".join(r for r in (self.shm_reason, self.nixl_reason) if r)
            raise ConfigError(f"no data plane left to offer: {reasons}")

    def _client_series(self) -> ClientSeries | None:
        """Where each client's chunk counts go.
        Only a node service counts them.
        Its clients are the engines of the machine, fetching over ``shm``."""
        return None

    def _open_slot_plane(self) -> tuple[SlotPlane | None, str | None]:
        """The ``shm`` plane, or ``None`` and why it cannot be offered.
        Only the node service, :class:`chunkstore.node.NodeServer`, lends slots of a shared pool."""
        return None, "the shm plane is the node service's (serve with chunkstore.node.NodeServer)"

    def stop(self) -> None:
        """Stop serving. Releases every lease and pin. Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout=10)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._sessions.clear()
        for _, done, _, _ in self._tracked:
            done()
        self._tracked.clear()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._wake_r = self._wake_w = -1
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._bound is not None:
            self._bound.remove()
            self._bound = None

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Block until :meth:`stop` is called from another thread or a signal handler."""
        while not self._stopping.wait(0.5):
            pass

    # --- I/O thread -----------------------------------------------------------------------

    def _open_socket(self) -> Any:
        zmq = _zmq()
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        # Larger frames make libzmq drop the connection before any byte reaches Python.
        router.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_frame_bytes)
        if not self._local:
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # Only for an IPv6 address: with the option a host name may resolve to IPv6 only.
            router.setsockopt(zmq.IPV6, int(self.config.bind.startswith("tcp://[")))
        router.setsockopt(zmq.SNDHWM, 1000)
        router.setsockopt(zmq.RCVHWM, 1000)
        # A reply that cannot go out (its client's queue is full, or it left) raises instead of
        # vanishing, so the leases it granted are given back (see _send_replies).
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self.config.curve_secret_key is not None:
            if self.config.curve_client_keys is not None:
                self._start_authenticator()
            router.curve_server = True
            router.curve_secretkey = self.config.curve_secret_key
            router.curve_publickey = self.config.curve_public_key
        bind = self.config.bind
        try:
            if self._local:
                self._bound = bind_owner_only(router, bind)
                self.endpoint = bind
            elif bind.endswith(":0"):
                port = router.bind_to_random_port(bind[:-2])
                self.endpoint = f"{bind[:-2]}:{port}"
            else:
                router.bind(bind)
                self.endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            router.close(0)  # an open socket would block the context's term() in stop()
            raise
        return router

    def _start_authenticator(self) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        allowed = set(self.config.curve_client_keys or ())

        class _AllowList:
            def callback(self, domain: str, key: bytes) -> bool:
                import zmq.utils.z85

                return zmq.utils.z85.encode(key) in allowed or key in allowed

        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_AllowList())

    def _run(self) -> None:
        zmq = _zmq()
        try:
            router = self._open_socket()
            # Node service: every connection is one engine, and its closing (exit, kill -9:
            # the kernel closes the socket) ends its sessions (see _disconnected).
            monitor = router.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                | (zmq.EVENT_DISCONNECTED if self._local else 0)
            )
            self._monitor = monitor
        except Exception as exc:  # noqa: BLE001 - reported to start()
            self._start_error = (
                exc
                if isinstance(exc, ConfigError)
                else ConfigError(f"cannot bind {self.config.bind}: {exc}")
            )
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                try:
                    self._turn(poller, router, monitor)
                except Exception:  # noqa: BLE001 - log and keep serving: never crash the server
                    log.exception("peer server: error in the I/O loop")
                    time.sleep(0.01)
        finally:
            self._send_replies(router)
            router.disable_monitor()
            monitor.close(0)
            router.close(0)
            if self._auth is not None:
                self._auth.stop()

    def _turn(self, poller: Any, router: Any, monitor: Any) -> None:
        zmq = _zmq()
        events = dict(poller.poll(50))
        if self._local:
            # Disconnects first: a connection's file descriptor may be reused by the next one.
            self._drain_monitor(monitor)
        if router in events:
            for _ in range(64):  # bounded batch, so replies and sweeps keep flowing
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._incoming(frames)
                except Exception:  # noqa: BLE001 - one bad message must not stop the others
                    log.exception("peer server: could not handle a message")
                    self._reject(P.INTERNAL)
        if monitor in events:
            self._drain_monitor(monitor)
        if self._wake_r in events:
            try:
                os.read(self._wake_r, 65536)
            except BlockingIOError:
                pass
        self._send_replies(router)
        self._sweep()

    def _drain_monitor(self, monitor: Any) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = _zmq()
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected(int(event["value"]))
            else:
                self._reject("handshake_failed")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (OSError, AttributeError):
            pass

    def _queue_reply(
        self,
        frames: list[Any],
        on_sent: Callable[[], None] | None = None,
        on_dropped: Callable[[], None] | None = None,
    ) -> None:
        """Send ``frames`` from the I/O thread.
        ``on_sent`` runs once they are out or dropped.
        ``on_dropped`` runs only if they could not be sent."""
        self._outbox.put((frames, on_sent, on_dropped))
        self._wake()

    def _send_replies(self, router: Any) -> None:
        zmq = _zmq()
        while True:
            try:
                frames, on_sent, on_dropped = self._outbox.get_nowait()
            except queue.Empty:
                break
            try:
                # Never block the I/O thread on one client's full queue: drop that reply.
                if on_sent is None:
                    router.send_multipart(frames, zmq.NOBLOCK, copy=False)
                else:
                    tracker = router.send_multipart(frames, zmq.NOBLOCK, copy=False, track=True)
                    pins = len(frames) - 3  # identity, body and tag, then one pinned chunk each
                    deadline = time.monotonic() + self.config.max_lease_ms / 1000
                    self._tracked.append((tracker, on_sent, pins, deadline))
            except Exception as exc:  # noqa: BLE001 - one bad reply must not stop the server
                if not isinstance(exc, zmq.ZMQError):
                    log.exception("peer server: reply could not be sent")
                log.debug("reply dropped: %s", exc)
                self._accounting.count("replies_dropped")
                if on_dropped is not None:
                    on_dropped()
                if on_sent is not None:
                    on_sent()

    def _sweep(self) -> None:
        if self._tracked:
            now = time.monotonic()
            still = []
            for entry in self._tracked:
                tracker, done, _, deadline = entry
                if tracker is None or tracker.done:
                    done()
                elif now >= deadline:
                    # A client that stops reading (a stalled process, a partition without a
                    # reset) would keep these chunks pinned as long as its connection lives:
                    # no longer than a lease may (spec §5.5). Their memory stays mapped; a
                    # slot reused under the unsent reply gives bytes the client's check
                    # refuses (§4.7), and it has long given up on that reply anyway.
                    self._accounting.count("inline_pins_expired")
                    done()
                else:
                    still.append(entry)
            self._tracked = still
        self._sessions.sweep()

    # --- request intake -----------------------------------------------------------------

    def _reject(self, reason: str) -> None:
        self._accounting.reject(reason)

    def _incoming(self, frames: list[Any]) -> None:
        ident = frames[0].bytes  # bytes, so that replies can be sent tracked
        try:
            body, data, authentic = self.codec.decode(frames[1:], reply=False)
        except ProtocolViolation as exc:
            self._reject(exc.code)
            self._refuse(ident, 0, exc.code, exc.reason, signed=False)
            return
        request_id: int = body["id"] if P.is_wire_int(body.get("id")) else 0
        if not authentic:
            self._reject(P.AUTH_FAILED)
            self._refuse(
                ident,
                request_id,
                P.AUTH_FAILED,
                "bad or missing message authentication code",
                signed=False,
            )
            return
        try:
            P.validate_request(body, self.config.limits)
        except ProtocolViolation as exc:
            self._reject(exc.code)
            extra: dict[str, Any] = (
                {"versions": sorted(P.ACCEPTED_VERSIONS)}
                if exc.code == P.UNSUPPORTED_VERSION
                else {}
            )
            self._refuse(ident, request_id, exc.code, exc.reason, **extra)
            return
        op = body["op"]
        if op != "hello":
            if self._sessions.touch(body["s"]) is None:
                self._reject(P.NO_SESSION)
                self._refuse(
                    ident, request_id, P.NO_SESSION, "unknown or expired session; say hello"
                )
                return
        self._accounting.request(op)
        source = _source_address(frames[1]) if op == "hello" else ""
        connection = self._connection_of(frames[1]) if op == "hello" and self._local else None
        # A node client's hello is admitted on this thread, in order with disconnect events.
        local_hello = connection is not None
        if op == "release" or local_hello or (self._on_io_thread and op != "push"):
            # cheap and latency sensitive: no worker hop
            self._handle(ident, body, data, source, connection)
            return
        assert self._pool is not None
        try:
            self._pool.submit(self._handle, ident, body, data, source, connection)
        except RuntimeError:  # shutting down
            pass

    def _refuse(
        self,
        ident: Any,
        request_id: int,
        code: str,
        reason: str,
        *,
        signed: bool = True,
        **extra: Any,
    ) -> None:
        # A reply is signed only when the request carried a valid tag. One that could not be
        # decoded or authenticated gets an untagged reply: signing replies to anyone would
        # hand out tagged messages to whoever asks, and the sender may not hold the key anyway
        # (a client never treats an untagged reply as anything but a failure).
        frames = self.codec.encode(
            P.error_body(request_id, code, reason, **extra), reply=True, sign=signed
        )
        self._queue_reply([ident, *frames])

    def _handle(
        self,
        ident: Any,
        body: dict[str, Any],
        data: list[Any],
        source: str = "",
        connection: int | None = None,
    ) -> None:
        request_id = body["id"]
        assert self._handlers is not None  # requests arrive only after start()
        try:
            result = self._handlers.handle(body, data, source, connection)
        except ProtocolViolation as exc:
            self._reject(exc.code)
            self._refuse(ident, request_id, exc.code, exc.reason)
            return
        except Exception as exc:  # noqa: BLE001 - a store failure is an error reply, not a crash
            log.exception("peer server: %s failed", body.get("op"))
            self._refuse(ident, request_id, P.INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        if result is None:
            return
        fields, out_data, on_sent = result
        frames = self.codec.encode(P.ok_body(request_id, **fields), out_data, reply=True)
        on_dropped = None
        if "lease" in fields:
            # A client that never gets this reply cannot name its lease, so could never
            # release it: the pins or reservations it grants would stay until the session
            # ends (a node session outlives a timed-out request, spec §7).
            session, lease = body["s"], fields["lease"]

            def on_dropped() -> None:
                self._sessions.close_lease(session, lease)

        self._queue_reply([ident, *frames], on_sent, on_dropped)

    def _connection_of(self, frame: Any) -> int:
        """The connection, by file descriptor, that a node client's ``hello`` came in on.

        Disconnect events name connections by descriptor.
        The next connection reuses a closed descriptor.
        So every disconnect queued before this message is taken first.
        libzmq queues the event before closing the descriptor.
        """
        if self._monitor is not None:
            self._drain_monitor(self._monitor)
        return int(frame.get(_zmq().SRCFD))

    def _disconnected(self, connection: int) -> None:
        """A node client's connection closed: end its sessions, releasing every lease and
        aborting every reservation it held."""
        ended = self._sessions.drop_connection(connection)
        if ended:
            self._accounting.count("connections_closed")
            log.debug("node connection %d closed: %d session(s) ended", connection, ended)

    def _forget(self, session: Session) -> None:
        """Drop what was loaded for an ended session (its NIXL agent, its unfinished TP
        chunks)."""
        if self._handlers is not None:
            self._handlers.session_ended(session)
        if session.nixl_remote is not None and self._staging is not None:
            self._staging.endpoint.remove_remote(session.nixl_remote)

    # --- introspection ------------------------------------------------------------------

    def info(self, **extra: Any) -> PeerInfo:
        """This server's registry record (for a :class:`~chunkstore.peer.Announcer`)."""
        capacity, used = capacity_of(self.store) or (None, None)
        curve = self.config.curve_public_key
        return PeerInfo(
            name=self.name,
            endpoint=self.endpoint,
            fingerprint=self.config.fingerprint.hex() if self.config.fingerprint else None,
            chunk_tokens=self.config.chunk_tokens,
            planes=tuple(self.planes),
            curve_public_key=curve.decode() if isinstance(curve, bytes) else curve,
            capacity_bytes=capacity,
            used_bytes=used,
            extra=dict(extra),
        )

    def stats(self) -> dict[str, Any]:
        """Counters and state: what ``stats`` returns on the wire and ``chunkstore peers`` shows."""
        counts = self._accounting.snapshot()
        held = self._sessions.sizes()
        out: dict[str, Any] = {
            "name": self.name,
            "endpoint": self.endpoint,
            "planes": list(self.planes),
            "nixl_reason": self.nixl_reason,
            "sessions": held["sessions"],
            "max_sessions": self.config.max_sessions,
            "session_bytes": held["session_bytes"],
            "leases": held["leases"],
            "pins": held["pins"],
            "inline_pins": sum(entry[2] for entry in list(self._tracked)),
            "uptime_s": round(time.time() - self.started_at, 3) if self.started_at else 0.0,
            "read_only": self.config.read_only,
            "authenticated": self.codec.authenticated,
            "curve": self.config.curve_secret_key is not None,
            "counts": counts,
            "capacity_bytes": None,
            "used_bytes": None,
        }
        if self._staging is not None:
            out["staging_used_bytes"] = self._staging.arena.used
        capacity = capacity_of(self.store)
        if capacity is not None:
            out["capacity_bytes"], out["used_bytes"] = capacity
        return out
