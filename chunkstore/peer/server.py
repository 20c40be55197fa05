"""PeerServer: exposes a store (a host cache, a tiered store, any Store) to other instances.

One I/O thread owns the ZeroMQ ROUTER socket: it receives, checks size,
framing, version and MAC, and hands valid requests to a small worker pool
(store calls may block on disk). Workers queue their replies and wake the I/O
thread through a pipe; only the I/O thread ever touches the socket, as ZeroMQ
requires. The same loop expires leases and idle sessions, so a dead client
cannot pin memory beyond its lease.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from chunkstore.backends.base import (
    Store,
    SupportsMemoryRegions,
    SupportsPinning,
    SupportsReserve,
)
from chunkstore.errors import ConfigError, FormatError, MissingDependency
from chunkstore.format import decode_chunk
from chunkstore.hashing import ChunkKey
from chunkstore.peer import metrics
from chunkstore.peer import protocol as P
from chunkstore.peer.arena import Allocation, Arena
from chunkstore.peer.discovery import PeerInfo
from chunkstore.peer.errors import ProtocolViolation
from chunkstore.peer.nixlplane import NixlEndpoint, address_of, nixl_unavailable_reason

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
    """(capacity, used) bytes when the object reports them (HostCache, TieredStore), else None."""
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


@dataclass(frozen=True, slots=True)
class PeerServerConfig:
    """How a peer server listens, whom it accepts and what it offers."""

    bind: str = "tcp://127.0.0.1:0"
    """ZeroMQ endpoint to listen on; port 0 picks a free port. Loopback by default."""
    name: str | None = None
    """Name in registries and ``stats`` (default: host:port)."""
    fingerprint: bytes | None = None
    """Model fingerprint served; clients with another one are refused. ``None``: any."""
    chunk_tokens: int | None = None
    """Tokens per chunk served; clients with another size are refused. ``None``: any."""
    secret: bytes | str | None = None
    """Shared secret for HMAC authentication of every message (default: $CHUNKSTORE_PEER_SECRET)."""
    use_env_secret: bool = True
    """Whether an unset ``secret`` falls back to $CHUNKSTORE_PEER_SECRET."""
    curve_secret_key: bytes | None = None
    """Z85 CURVE secret key: encrypts the control and inline data traffic when set."""
    curve_public_key: bytes | None = None
    """Z85 CURVE public key matching ``curve_secret_key`` (published to clients)."""
    curve_client_keys: tuple[bytes, ...] | None = None
    """Z85 public keys of clients allowed to connect under CURVE; ``None``: any client key."""
    planes: tuple[str, ...] = (P.PLANE_NIXL, P.PLANE_INLINE)
    """Data planes offered; NIXL is dropped automatically when it cannot start."""
    staging_bytes: int = 64 << 20
    """NIXL staging arena for chunks of stores that cannot pin in place."""
    default_lease_ms: int = 5_000
    """Lease length when a client asks for 0."""
    max_lease_ms: int = 30_000
    """Longest lease granted; longer requests are clamped."""
    session_idle_s: float = 300.0
    """Sessions (and their leases) idle this long are dropped."""
    max_sessions: int = 1024
    """Most sessions held at once. At the cap a ``hello`` evicts the least recently used
    session idle for ``session_evict_idle_s``, or is refused with ``too_many_sessions``."""
    max_sessions_per_client: int = 64
    """Most sessions of one client identity (source address and ``client`` name); a further
    ``hello`` of that identity evicts its least recently used session."""
    session_evict_idle_s: float = 1.0
    """Under pressure, sessions idle at least this long may be evicted for a new one."""
    workers: int = 4
    """Threads running store calls."""
    read_only: bool = False
    """Refuse ``push`` and ``delete``."""
    verify_push: bool = True
    """Check every pushed chunk (checksum, key, fingerprint) before storing it. Turn off only
    when every reader verifies anyway and the pushers are trusted."""
    limits: P.Limits = field(default_factory=P.Limits)
    """Message size limits."""
    handle_on_io_thread: bool | None = None
    """Answer requests on the I/O thread (saves a thread hop per request, ~0.1 ms) instead
    of the worker pool. Only for stores that never block; ``None``: yes for in-memory
    stores (kind ``memory`` or ``host``), no otherwise (a tiered store may read a disk)."""


_Result = tuple[dict[str, Any], Sequence[Any], Callable[[], None] | None]


def _source_address(frame: Any) -> str:
    """The sender's address as ZeroMQ reports it ("" where the transport has none)."""
    try:
        return str(frame.get("Peer-Address"))
    except Exception:  # noqa: BLE001 - not every transport or libzmq exposes it
        return ""


@dataclass
class _Session:
    client: str
    identity: tuple[str, str]
    """Source address and ``client`` name: the unit of ``max_sessions_per_client``."""
    planes: tuple[str, ...]
    nixl_remote: str | None
    last_seen: float
    retained: int
    """Bytes the client made us keep (its name and NIXL metadata), for ``stats``."""


@dataclass
class _Lease:
    session: bytes
    expires: float
    releases: list[Callable[[], None]]


class PeerServer:
    """Serves ``store`` over the peer protocol (spec/PROTOCOL.md) until :meth:`stop`."""

    def __init__(
        self, store: Store, config: PeerServerConfig | None = None, **overrides: Any
    ) -> None:
        config = replace(config or PeerServerConfig(), **overrides)
        if config.default_lease_ms <= 0 or config.max_lease_ms < config.default_lease_ms:
            raise ConfigError("need 0 < default_lease_ms <= max_lease_ms")
        unknown = set(config.planes) - {P.PLANE_NIXL, P.PLANE_INLINE}
        if unknown or not config.planes:
            raise ConfigError(f"unknown data planes {sorted(unknown)}; use 'nixl' and/or 'inline'")
        if (config.curve_secret_key is None) != (config.curve_public_key is None):
            raise ConfigError("CURVE needs both curve_secret_key and curve_public_key")
        if config.max_sessions < 1 or config.max_sessions_per_client < 1:
            raise ConfigError("max_sessions and max_sessions_per_client must be at least 1")
        if not config.session_evict_idle_s >= 0:
            raise ConfigError("session_evict_idle_s must be >= 0")
        self.store = store
        self.config = config
        self._secret = P.secret_from(config.secret, use_env=config.use_env_secret)
        self.codec = P.Codec(self._secret, config.limits)
        self._sessions: dict[bytes, _Session] = {}
        self._leases: dict[bytes, _Lease] = {}
        self._state_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple[list[Any], Callable[[], None] | None]] = (
            queue.SimpleQueue()
        )
        self._tracked: list[tuple[Any, Callable[[], None]]] = []
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._nixl: NixlEndpoint | None = None
        self._staging: Arena | None = None
        self.nixl_reason: str | None = None
        self.planes: tuple[str, ...] = ()
        self.endpoint = ""
        self.started_at = 0.0
        self._pinning = isinstance(store, SupportsPinning)
        self._on_io_thread = (
            config.handle_on_io_thread
            if config.handle_on_io_thread is not None
            else getattr(store, "kind", "") in ("memory", "host")
        )
        self._reserving = isinstance(store, SupportsReserve)

    # --- lifecycle ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The server's name (config, else its endpoint)."""
        return self.config.name or self.endpoint.removeprefix("tcp://")

    def start(self) -> PeerServer:
        """Bind, start NIXL (when offered and available) and the I/O thread; returns self."""
        zmq = _zmq()
        self._setup_nixl()
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

    def _setup_nixl(self) -> None:
        if P.PLANE_NIXL not in self.config.planes:
            self.planes = tuple(self.config.planes)
            return
        reason = nixl_unavailable_reason()
        if reason is None:
            try:
                endpoint = NixlEndpoint("server")
                self._staging = Arena(self.config.staging_bytes)
                endpoint.register(self._staging.array)
                if isinstance(self.store, SupportsMemoryRegions):
                    for region in self.store.memory_regions():
                        endpoint.register(region)
                self._nixl = endpoint
            except Exception as exc:  # noqa: BLE001 - fall back to the inline plane, reported
                reason = f"NIXL could not start: {exc}"
        self.nixl_reason = reason
        self.planes = tuple(
            p for p in self.config.planes if p != P.PLANE_NIXL or self._nixl is not None
        )
        if not self.planes:
            raise ConfigError(f"no data plane left to offer: {reason}")

    def stop(self) -> None:
        """Stop serving; releases every lease and pin. Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._wake()
            self._thread.join(timeout=10)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._state_lock:
            leases, self._leases = list(self._leases.values()), {}
            self._sessions.clear()
        for lease in leases:
            self._release_lease(lease)
        for _, done in self._tracked:
            done()
        self._tracked.clear()
        metrics.SERVER_LEASES.labels(self.name).set(0)
        metrics.SERVER_SESSIONS.labels(self.name).set(0)
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None
        for fd in ("_wake_r", "_wake_w"):
            if hasattr(self, fd):
                try:
                    os.close(getattr(self, fd))
                except OSError:
                    pass
                delattr(self, fd)
        if hasattr(self, "_ctx"):
            self._ctx.term()
            del self._ctx

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
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.setsockopt(zmq.SNDHWM, 1000)
        router.setsockopt(zmq.RCVHWM, 1000)
        if self.config.curve_secret_key is not None:
            if self.config.curve_client_keys is not None:
                self._start_authenticator()
            router.curve_server = True
            router.curve_secretkey = self.config.curve_secret_key
            router.curve_publickey = self.config.curve_public_key
        bind = self.config.bind
        if bind.endswith(":0"):
            port = router.bind_to_random_port(bind[:-2])
            self.endpoint = f"{bind[:-2]}:{port}"
        else:
            router.bind(bind)
            self.endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
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
            monitor = router.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
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
            if hasattr(self, "_auth"):
                self._auth.stop()

    def _turn(self, poller: Any, router: Any, monitor: Any) -> None:
        zmq = _zmq()
        events = dict(poller.poll(50))
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
                recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._reject("handshake_failed")

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (OSError, AttributeError):
            pass

    def _queue_reply(self, frames: list[Any], on_sent: Callable[[], None] | None = None) -> None:
        self._outbox.put((frames, on_sent))
        self._wake()

    def _send_replies(self, router: Any) -> None:
        zmq = _zmq()
        while True:
            try:
                frames, on_sent = self._outbox.get_nowait()
            except queue.Empty:
                break
            try:
                if on_sent is None:
                    router.send_multipart(frames, copy=False)
                else:
                    tracker = router.send_multipart(frames, copy=False, track=True)
                    self._tracked.append((tracker, on_sent))
            except Exception as exc:  # noqa: BLE001 - one bad reply must not stop the server
                if not isinstance(exc, zmq.ZMQError):
                    log.exception("peer server: reply could not be sent")
                log.debug("reply dropped: %s", exc)
                if on_sent is not None:
                    on_sent()

    def _sweep(self) -> None:
        if self._tracked:
            still = []
            for tracker, done in self._tracked:
                if tracker is None or tracker.done:
                    done()
                else:
                    still.append((tracker, done))
            self._tracked = still
        now = time.monotonic()
        expired: list[_Lease] = []
        dropped: list[_Session] = []
        with self._state_lock:
            for lease_id in [k for k, v in self._leases.items() if v.expires <= now]:
                expired.append(self._leases.pop(lease_id))
            idle = now - self.config.session_idle_s
            for sid in [k for k, v in self._sessions.items() if v.last_seen < idle]:
                dropped.append(self._sessions.pop(sid))
                expired.extend(self._pop_leases_of(sid))
            open_leases = len(self._leases)
        for lease in expired:
            self._count("leases_expired")
            self._release_lease(lease)
        for session in dropped:
            self._drop_session(session)
        if expired:
            metrics.SERVER_LEASES.labels(self.name).set(open_leases)
        if dropped:
            self._sessions_changed()

    def _pop_leases_of(self, session_id: bytes) -> list[_Lease]:
        """Remove the leases of one session (caller holds ``_state_lock``)."""
        return [
            self._leases.pop(k) for k, v in list(self._leases.items()) if v.session == session_id
        ]

    def _sessions_changed(self) -> None:
        with self._state_lock:
            count = len(self._sessions)
        metrics.SERVER_SESSIONS.labels(self.name).set(count)

    # --- request intake -----------------------------------------------------------------

    def _count(self, what: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[what] += n

    def _reject(self, reason: str) -> None:
        self._count(f"rejected_{reason}")
        metrics.SERVER_REJECTED.labels(self.name, reason).inc()

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
            with self._state_lock:
                session = self._sessions.get(body["s"])
                if session is not None:
                    session.last_seen = time.monotonic()
            if session is None:
                self._reject(P.NO_SESSION)
                self._refuse(
                    ident, request_id, P.NO_SESSION, "unknown or expired session; say hello"
                )
                return
        metrics.SERVER_REQUESTS.labels(self.name, op).inc()
        self._count(f"op_{op}")
        source = _source_address(frames[1]) if op == "hello" else ""
        if op == "release" or (self._on_io_thread and op != "push"):
            self._handle(ident, body, data, source)  # cheap and latency sensitive: no worker hop
            return
        assert self._pool is not None
        try:
            self._pool.submit(self._handle, ident, body, data, source)
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

    def _handle(self, ident: Any, body: dict[str, Any], data: list[Any], source: str = "") -> None:
        request_id = body["id"]
        try:
            if body["op"] == "hello":
                result: _Result | None = self._op_hello(body, source)
            else:
                result = getattr(self, f"_op_{body['op']}")(body, data)
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
        self._queue_reply([ident, *frames], on_sent)

    # --- operations ------------------------------------------------------------------

    def _op_hello(self, body: dict[str, Any], source: str) -> _Result:
        cfg = self.config
        if P.PROTOCOL_VERSION not in body["versions"]:
            raise ProtocolViolation(
                P.UNSUPPORTED_VERSION,
                f"no common protocol version (this peer speaks {sorted(P.ACCEPTED_VERSIONS)})",
            )
        fp = body["fingerprint"]
        if cfg.fingerprint is not None and fp is not None and fp != cfg.fingerprint:
            raise ProtocolViolation(
                P.FINGERPRINT_MISMATCH,
                f"this peer serves model fingerprint {cfg.fingerprint.hex()[:16]}…, "
                f"the client has {fp.hex()[:16]}…",
            )
        tokens = body["chunk_tokens"]
        if cfg.chunk_tokens is not None and tokens is not None and tokens != cfg.chunk_tokens:
            raise ProtocolViolation(
                P.CHUNK_TOKENS_MISMATCH,
                f"this peer serves {cfg.chunk_tokens}-token chunks, the client uses {tokens}",
            )
        planes = tuple(p for p in self.planes if p in body["planes"])
        nixl_reason = self.nixl_reason
        remote = None
        if P.PLANE_NIXL in planes and body["nixl_md"]:
            remote = self._nixl.add_remote(body["nixl_md"]) if self._nixl is not None else None
            if remote is None:
                # Metadata NIXL cannot load would fail every transfer of this session.
                planes = tuple(p for p in planes if p != P.PLANE_NIXL)
                nixl_reason = "NIXL rejected the client's agent metadata"
        client = body["client"]
        session = _Session(
            client=client,
            identity=(source, client),
            planes=planes,
            nixl_remote=remote,
            last_seen=time.monotonic(),
            retained=len(client.encode("utf-8", "surrogatepass")) + len(body["nixl_md"] or b""),
        )
        session_id = P.new_token(P.SESSION_BYTES)
        try:
            self._admit(session_id, session)
        except ProtocolViolation:
            self._drop_session(session)
            raise
        reply: dict[str, Any] = {
            "s": session_id,
            "server": self.name,
            "version": P.PROTOCOL_VERSION,
            "fingerprint": cfg.fingerprint,
            "chunk_tokens": cfg.chunk_tokens,
            "planes": list(planes),
            "limits": cfg.limits.as_dict(),
            "lease_ms_max": cfg.max_lease_ms,
            "read_only": cfg.read_only,
            "staging_bytes": self._staging.size if self._staging else 0,
            "nixl_reason": nixl_reason,
        }
        if self._nixl is not None and P.PLANE_NIXL in planes:
            reply["nixl_md"] = self._nixl.metadata()
            reply["nixl_agent"] = self._nixl.name
        return reply, (), None

    def _admit(self, session_id: bytes, session: _Session) -> None:
        """Add a session within the caps, evicting a least recently used one where allowed.

        A client identity at its cap loses its own oldest session (a client that says hello
        again has most likely lost the old one). A full server evicts the least recently used
        session idle at least ``session_evict_idle_s``, preferring sessions without leases;
        when every session is busier than that, the hello is refused.
        """
        cfg = self.config
        now = time.monotonic()
        with self._state_lock:
            mine = [k for k, v in self._sessions.items() if v.identity == session.identity]
            if len(mine) >= cfg.max_sessions_per_client:
                victim: bytes | None = self._least_recent(mine)
                cause = "per_client"
            elif len(self._sessions) >= cfg.max_sessions:
                idle = now - cfg.session_evict_idle_s
                victim = self._least_recent(
                    [k for k, v in self._sessions.items() if v.last_seen <= idle]
                )
                cause = "full"
            else:
                victim, cause = None, ""
            if cause and victim is None:
                raise ProtocolViolation(
                    P.TOO_MANY_SESSIONS,
                    f"this peer holds {len(self._sessions)} active sessions; retry later",
                )
            evicted = self._sessions.pop(victim) if victim is not None else None
            leases = self._pop_leases_of(victim) if victim is not None else []
            self._sessions[session_id] = session
            count, open_leases = len(self._sessions), len(self._leases)
        for lease in leases:
            self._release_lease(lease)
        if leases:
            metrics.SERVER_LEASES.labels(self.name).set(open_leases)
        if evicted is not None:
            self._drop_session(evicted)
            self._count(f"sessions_evicted_{cause}")
            metrics.SERVER_SESSIONS_EVICTED.labels(self.name, cause).inc()
        metrics.SERVER_SESSIONS.labels(self.name).set(count)

    def _least_recent(self, candidates: list[bytes]) -> bytes | None:
        """The candidate to evict first: no leases before leases, then least recently seen."""
        if not candidates:
            return None
        leased = {v.session for v in self._leases.values()}
        return min(candidates, key=lambda k: (k in leased, self._sessions[k].last_seen))

    def _op_lookup(self, body: dict[str, Any], data: list[Any]) -> _Result:
        keys = P.unpack_keys(body["keys"], self.config.limits)
        return {"prefix": self.store.lookup_prefix(keys) if keys else 0}, (), None

    def _op_exists(self, body: dict[str, Any], data: list[Any]) -> _Result:
        keys = P.unpack_keys(body["keys"], self.config.limits)
        return {"present": self.store.exists_many(keys) if keys else []}, (), None

    def _op_fetch(self, body: dict[str, Any], data: list[Any]) -> _Result:
        keys = P.unpack_keys(body["keys"], self.config.limits)
        plane = body["plane"]
        session = self._session(body["s"])
        if plane not in session.planes:
            raise ProtocolViolation(P.DATAPLANE_UNAVAILABLE, f"data plane {plane!r} is not offered")
        # `use: false` marks a maintenance read (verify, cp): it must not count as a use of
        # the chunks, so no pins (acquire counts a hit) and no access-time update.
        use = body.get("use", True)
        if plane == P.PLANE_NIXL:
            return self._fetch_nixl(body, keys, use=use)
        return self._fetch_inline(keys, use=use)

    def _read(self, keys: list[ChunkKey], use: bool) -> list[Any]:
        return self.store.get_many(keys) if use else self.store.read_unchecked_many(keys)

    def _fetch_inline(self, keys: list[ChunkKey], *, use: bool = True) -> _Result:
        sizes: list[int | None] = []
        frames: list[Any] = []
        releases: list[Callable[[], None]] = []
        budget = self.config.limits.max_message_bytes
        if self._pinning and use:
            for key in keys:
                pin = self.store.acquire(key)  # type: ignore[attr-defined]
                if pin is None or len(pin.view) > budget:
                    if pin is not None:
                        self.store.release(pin)  # type: ignore[attr-defined]
                    sizes.append(None)
                    continue
                budget -= len(pin.view)
                sizes.append(len(pin.view))
                frames.append(pin.view)
                releases.append(partial(self.store.release, pin))  # type: ignore[attr-defined]
        else:
            for blob in self._read(keys, use):
                if blob is None or len(blob) > budget:
                    sizes.append(None)
                    continue
                budget -= len(blob)
                sizes.append(len(blob))
                frames.append(blob)
        hits = len(frames)
        self._account(hits, len(keys) - hits, P.PLANE_INLINE, sum(s or 0 for s in sizes))

        def on_sent() -> None:
            for release in releases:
                release()

        return {"sizes": sizes}, frames, on_sent if releases else None

    def _fetch_nixl(
        self, body: dict[str, Any], keys: list[ChunkKey], *, use: bool = True
    ) -> _Result:
        assert self._nixl is not None
        lease_ms = min(body["lease_ms"] or self.config.default_lease_ms, self.config.max_lease_ms)
        items: list[list[int] | None] = []
        releases: list[Callable[[], None]] = []
        pending: list[int] = []  # indices that go through the staging arena
        if self._pinning and use:
            for i, key in enumerate(keys):
                pin = self.store.acquire(key)  # type: ignore[attr-defined]
                if pin is None:
                    items.append(None)
                    continue
                address, size = address_of(pin.view)
                if self._nixl.registered(address, size):
                    self._count("served_in_place")
                    items.append([address, size])
                    releases.append(partial(self.store.release, pin))  # type: ignore[attr-defined]
                    continue
                items.append(None)  # not in a registered pool: stage a copy, unpin at once
                try:
                    allocation = self._stage(pin.view)
                finally:
                    self.store.release(pin)  # type: ignore[attr-defined]
                if allocation is None:
                    self._count("staging_full")
                    continue
                assert self._staging is not None
                items[i] = [self._staging.address_of(allocation), size]
                releases.append(partial(self._staging.free, allocation))
        else:
            items = [None] * len(keys)
            pending = list(range(len(keys)))
        if pending:
            blobs = self._read([keys[i] for i in pending], use)
            for i, blob in zip(pending, blobs):
                if blob is None:
                    continue
                allocation = self._stage(blob)
                if allocation is None:
                    self._count("staging_full")
                    continue
                assert self._staging is not None
                items[i] = [self._staging.address_of(allocation), len(blob)]
                releases.append(partial(self._staging.free, allocation))
        hits = sum(item is not None for item in items)
        self._account(hits, len(keys) - hits, P.PLANE_NIXL, sum(it[1] for it in items if it))
        lease_id = P.new_token(P.LEASE_BYTES)
        if releases:
            with self._state_lock:
                self._leases[lease_id] = _Lease(
                    body["s"], time.monotonic() + lease_ms / 1000, releases
                )
                open_leases = len(self._leases)
            metrics.SERVER_LEASES.labels(self.name).set(open_leases)
        return {"lease": lease_id, "lease_ms": lease_ms, "items": items}, (), None

    def _stage(self, blob: Any) -> Allocation | None:
        assert self._staging is not None
        allocation = self._staging.allocate(len(blob))
        if allocation is not None:
            self._staging.view(allocation)[:] = memoryview(blob).cast("B")
        return allocation

    def _account(self, hits: int, misses: int, plane: str, nbytes: int) -> None:
        self._count("chunks_hit", hits)
        self._count("chunks_missed", misses)
        self._count(f"bytes_out_{plane}", nbytes)
        metrics.SERVER_CHUNKS.labels(self.name, "hit").inc(hits)
        metrics.SERVER_CHUNKS.labels(self.name, "miss").inc(misses)
        metrics.SERVER_BYTES.labels(self.name, plane, "out").inc(nbytes)

    def _op_release(self, body: dict[str, Any], data: list[Any]) -> _Result | None:
        with self._state_lock:
            lease = self._leases.get(body["lease"])
            if lease is not None and lease.session == body["s"]:
                del self._leases[body["lease"]]
            else:
                lease = None
            open_leases = len(self._leases)
        if lease is not None:
            self._release_lease(lease)
            metrics.SERVER_LEASES.labels(self.name).set(open_leases)
        if not body["ack"]:
            return None
        if lease is None:
            raise ProtocolViolation(P.UNKNOWN_LEASE, "no such lease (expired or released)")
        return {"released": True}, (), None

    def _release_lease(self, lease: _Lease) -> None:
        for release in lease.releases:
            try:
                release()
            except Exception:  # noqa: BLE001 - one failing unpin must not keep the others pinned
                log.exception("peer server: releasing a pin failed")

    def _op_push(self, body: dict[str, Any], data: list[Any]) -> _Result:
        if self.config.read_only:
            raise ProtocolViolation(P.READ_ONLY, "this peer does not accept pushed chunks")
        keys = P.unpack_keys(body["keys"], self.config.limits)
        sizes = body["sizes"]  # non-negative and within the frame limit (validate_request)
        plane = body["plane"]
        if len(sizes) != len(keys):
            raise ProtocolViolation(P.MALFORMED, "push: one size per key is required")
        session = self._session(body["s"])
        if plane not in session.planes:
            raise ProtocolViolation(P.DATAPLANE_UNAVAILABLE, f"data plane {plane!r} is not offered")
        stored = [False] * len(keys)
        written = [False] * len(keys)
        todo = list(range(len(keys)))
        if body["mode"] == "if_absent":
            present = self.store.exists_many(keys)
            stored = list(present)
            todo = [i for i, here in enumerate(present) if not here]
        if plane == P.PLANE_INLINE:
            if len(data) != len(keys):
                raise ProtocolViolation(P.MALFORMED, "push: one data frame per key is required")
            blobs: list[Any] = [
                frame.buffer if hasattr(frame, "buffer") else frame for frame in data
            ]
            if any(len(b) != s for b, s in zip(blobs, sizes)):
                raise ProtocolViolation(P.MALFORMED, "push: frame sizes disagree with 'sizes'")
            direct: list[int] = []
        else:
            addrs = body["addrs"]
            if len(addrs) != len(keys):
                raise ProtocolViolation(P.MALFORMED, "push: one source address per key is required")
            blobs = [None] * len(keys)
            direct = self._pull_nixl(session, keys, sizes, addrs, todo, blobs)
        for i in direct:
            stored[i] = written[i] = True
        skip = set(direct)
        accepted = [
            (i, keys[i], blobs[i])
            for i in todo
            if i not in skip and blobs[i] is not None and self._valid(keys[i], blobs[i])
        ]
        if accepted:
            items = [(k, b) for _, k, b in accepted]
            results = (
                self.store.put_many(items)
                if body["mode"] == "overwrite"
                else self.store.put_if_absent_many(items)
            )
            here = self.store.exists_many([k for _, k, _ in accepted])
            for (i, _, _), wrote, ok in zip(accepted, results, here):
                written[i], stored[i] = bool(wrote), bool(ok)
        nbytes = sum(sizes[i] for i in range(len(keys)) if written[i])
        self._count(f"bytes_in_{plane}", nbytes)
        metrics.SERVER_BYTES.labels(self.name, plane, "in").inc(nbytes)
        self._count("chunks_pushed", sum(written))
        return {"stored": stored, "written": written}, (), None

    def _pull_nixl(
        self,
        session: _Session,
        keys: list[ChunkKey],
        sizes: list[int],
        addrs: list[int],
        todo: list[int],
        blobs: list[Any],
    ) -> list[int]:
        """READ pushed chunks from the client: straight into reserved slots where the store
        offers them (verified, then committed; returns those indices), else via staging
        into ``blobs``."""
        nixl, staging = self._nixl, self._staging
        if session.nixl_remote is None or nixl is None or staging is None:
            raise ProtocolViolation(
                P.DATAPLANE_UNAVAILABLE, "push over NIXL needs NIXL metadata in hello"
            )
        deadline = time.monotonic() + self.config.default_lease_ms / 1000
        committed: list[int] = []
        for i in todo:
            key, address, size = keys[i], addrs[i], sizes[i]
            lease = self.store.reserve(key) if self._reserving else None  # type: ignore[attr-defined]
            if lease is not None:
                slot = lease.view
                local, room = address_of(slot)
                if room >= size and nixl.registered(local, size):
                    ok = nixl.read(session.nixl_remote, [(local, address, size)], deadline)
                    if ok and self._valid(key, slot[:size]):
                        self.store.commit(lease, size)  # type: ignore[attr-defined]
                        committed.append(i)
                    else:
                        self.store.abort(lease)  # type: ignore[attr-defined]
                    continue
                self.store.abort(lease)  # type: ignore[attr-defined]
            allocation = staging.allocate(size)
            if allocation is None:
                self._count("staging_full")
                continue
            try:
                if nixl.read(
                    session.nixl_remote, [(staging.address_of(allocation), address, size)], deadline
                ):
                    blobs[i] = bytes(staging.view(allocation))
            finally:
                staging.free(allocation)
        return committed

    def _valid(self, key: ChunkKey, blob: Any) -> bool:
        if not self.config.verify_push:
            return True
        try:
            decode_chunk(
                blob, expected_key=key.digest, expected_fingerprint=self.config.fingerprint
            )
        except FormatError as exc:
            log.warning("peer server %s: pushed chunk %s refused: %s", self.name, key.hex, exc)
            self._count("pushed_corrupt")
            return False
        return True

    def _op_delete(self, body: dict[str, Any], data: list[Any]) -> _Result:
        if self.config.read_only:
            raise ProtocolViolation(P.READ_ONLY, "this peer does not accept deletes")
        keys = P.unpack_keys(body["keys"], self.config.limits)
        present = self.store.exists_many(keys) if keys else []
        gone = [k for k, here in zip(keys, present) if here]
        if gone:
            self.store.delete_many(gone)
        return {"deleted": present}, (), None

    def _op_list(self, body: dict[str, Any], data: list[Any]) -> _Result:
        # namespace, after and limit follow the field grammar (validate_request): nothing
        # path-like reaches the store.
        limit = min(body["limit"], self.config.limits.max_keys)
        after = body["after"]
        entries = sorted(
            (P.pack_keys([info.key]), info.size, info.mtime, info.atime)
            for info in self.store.list(body["namespace"])
        )
        start = 0
        if after is not None:
            import bisect

            start = bisect.bisect_right(entries, (after, float("inf")))
        page = entries[start : start + limit]
        return {"entries": [list(e) for e in page], "more": start + limit < len(entries)}, (), None

    def _op_stats(self, body: dict[str, Any], data: list[Any]) -> _Result:
        return {"stats": self.stats()}, (), None

    def _op_bye(self, body: dict[str, Any], data: list[Any]) -> _Result:
        with self._state_lock:
            session = self._sessions.pop(body["s"], None)
            leases = self._pop_leases_of(body["s"])
        for lease in leases:
            self._release_lease(lease)
        if session is not None:
            self._drop_session(session)
            self._sessions_changed()
        return {}, (), None

    def _session(self, session_id: bytes) -> _Session:
        with self._state_lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise ProtocolViolation(P.NO_SESSION, "unknown or expired session; say hello")
        return session

    def _drop_session(self, session: _Session) -> None:
        if session.nixl_remote is not None and self._nixl is not None:
            self._nixl.remove_remote(session.nixl_remote)

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
        with self._count_lock:
            counts = dict(self._counts)
        with self._state_lock:
            sessions, leases = len(self._sessions), len(self._leases)
            session_bytes = sum(v.retained for v in self._sessions.values())
            pins = sum(len(v.releases) for v in self._leases.values())
        out: dict[str, Any] = {
            "name": self.name,
            "endpoint": self.endpoint,
            "planes": list(self.planes),
            "nixl_reason": self.nixl_reason,
            "sessions": sessions,
            "max_sessions": self.config.max_sessions,
            "session_bytes": session_bytes,
            "leases": leases,
            "pins": pins,
            "uptime_s": round(time.time() - self.started_at, 3) if self.started_at else 0.0,
            "read_only": self.config.read_only,
            "authenticated": self.codec.authenticated,
            "curve": self.config.curve_secret_key is not None,
            "counts": counts,
            "capacity_bytes": None,
            "used_bytes": None,
        }
        if self._staging is not None:
            out["staging_used_bytes"] = self._staging.used
        capacity = capacity_of(self.store)
        if capacity is not None:
            out["capacity_bytes"], out["used_bytes"] = capacity
        return out
