"""Finding peers: a static list, a registry directory on a shared mount, or Redis.

Servers announce a :class:`PeerInfo` with a heartbeat, see :class:`Announcer`.
An entry not renewed within its TTL disappears.
Redis expires the key. The file registry ignores stale files and later removes them.
So a crashed server drops out on its own.
Clients call ``peers()`` on any source.

``peers()`` is forgiving: an unreachable registry lists nobody.
So a serving client degrades to fewer peers.
Tools that must tell "empty" from "unreachable" call the registry's ``check()`` first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from chunkstore.backends._fsio import read_regular
from chunkstore.backends._layout import temp_name
from chunkstore.errors import ConfigError, MissingDependency, StoreError

log = logging.getLogger(__name__)

_SUFFIX = ".peer.json"
MAX_RECORD_BYTES = 64 << 10
"""Largest registry record read. Anything bigger is not a record a server wrote."""
_TEXT_FIELDS = ("name", "endpoint")
_OPTIONAL_TEXT_FIELDS = ("fingerprint", "curve_public_key")
_OPTIONAL_INT_FIELDS = ("chunk_tokens", "capacity_bytes", "used_bytes")


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a server announces about itself."""

    name: str
    """Unique name (default host:port)."""
    endpoint: str
    """ZeroMQ endpoint clients connect to (``tcp://host:port``)."""
    fingerprint: str | None = None
    """Model fingerprint served, in hex. ``None`` serves any."""
    chunk_tokens: int | None = None
    """Tokens per chunk served."""
    planes: tuple[str, ...] = ()
    """Data planes offered (``nixl``, ``inline``)."""
    curve_public_key: str | None = None
    """Z85 CURVE public key when the server encrypts."""
    capacity_bytes: int | None = None
    """Bytes the served store can hold, when it says."""
    used_bytes: int | None = None
    """Bytes it holds at the last heartbeat."""
    expires_at: float = 0.0
    """Wall-clock time (seconds since the epoch) after which the entry is stale."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form labels (role: prefill/decode, zone, ...)."""

    def to_json(self) -> str:
        """The registry record."""
        data = asdict(self)
        data["planes"] = list(self.planes)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> PeerInfo:
        """Parse a registry record; raises ValueError when it is not one.

        Anyone who can write the registry can write a record.
        So every field is type-checked here.
        Readers skip a bad record. It never crashes them.
        """
        if len(text) > MAX_RECORD_BYTES:
            raise ValueError("not a peer record (too large)")
        data = json.loads(text)
        if not isinstance(data, dict) or not _is_record(data):
            raise ValueError("not a peer record")
        known = {f for f in cls.__dataclass_fields__}
        data = {k: v for k, v in data.items() if k in known}
        data["planes"] = tuple(data.get("planes") or ())
        return cls(**data)

    @property
    def expired(self) -> bool:
        """Whether the heartbeat is overdue."""
        return bool(self.expires_at) and self.expires_at < time.time()


@runtime_checkable
class PeerSource(Protocol):
    """Anything that lists peers."""

    def peers(self) -> list[PeerInfo]:
        """The live peers now.
        Raises :class:`StoreError` when the source cannot be read at all.
        An unreachable registry is not an empty one: readers keep the peers they know."""
        ...


@runtime_checkable
class Registry(PeerSource, Protocol):
    """A source servers can announce themselves in."""

    def announce(self, info: PeerInfo, ttl_s: float) -> None:
        """Publish or renew ``info`` for ``ttl_s`` seconds."""
        ...

    def withdraw(self, name: str) -> None:
        """Remove an entry now (clean shutdown)."""
        ...


class StaticPeers:
    """A fixed list of endpoints (``tcp://host:port``, ``host:port`` or ``ipc:///path``)."""

    def __init__(self, endpoints: Sequence[str]) -> None:
        self._infos = [
            PeerInfo(
                name=e.removeprefix("tcp://"),
                endpoint=e if e.startswith(("tcp://", "ipc://")) else f"tcp://{e}",
            )
            for e in endpoints
        ]

    def peers(self) -> list[PeerInfo]:
        """The configured endpoints."""
        return list(self._infos)

    def __repr__(self) -> str:
        return f"StaticPeers({[i.endpoint for i in self._infos]})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_record(data: dict[str, Any]) -> bool:
    """Whether ``data`` has the types of a :class:`PeerInfo` record (spec/PROTOCOL.md §8)."""
    planes = data.get("planes") or []
    expires = data.get("expires_at", 0.0)
    return (
        all(isinstance(data.get(f), str) for f in _TEXT_FIELDS)
        and all(data.get(f) is None or isinstance(data.get(f), str) for f in _OPTIONAL_TEXT_FIELDS)
        and all(data.get(f) is None or _is_int(data.get(f)) for f in _OPTIONAL_INT_FIELDS)
        and isinstance(planes, list)
        and all(isinstance(p, str) for p in planes)
        and (_is_int(expires) or (isinstance(expires, float) and math.isfinite(expires)))
        and isinstance(data.get("extra", {}), dict)
    )


class FileRegistry:
    """One JSON file per server in a directory every instance can see.

    The directory may be on NFS, on Lustre, or local.
    ``clock`` gives the wall-clock time records expire against, in seconds since the epoch.
    Tests pass a fake one to drive expiry without sleeping.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        cleanup_after_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = Path(directory)
        self.cleanup_after_s = cleanup_after_s
        self._clock = clock

    def check(self) -> None:
        """Raise :class:`StoreError` unless the directory exists and can be listed."""
        if not self.directory.exists():
            raise StoreError(f"peer registry {self.directory}: no such directory")
        if not self.directory.is_dir():
            raise StoreError(f"peer registry {self.directory}: not a directory")
        try:
            with os.scandir(self.directory) as entries:
                next(entries, None)
        except OSError as exc:
            raise self._cannot_list(exc) from None

    def _cannot_list(self, exc: OSError) -> StoreError:
        return StoreError(f"peer registry {self.directory}: cannot list it ({exc.strerror or exc})")

    def _path(self, name: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return self.directory / f"{safe}{_SUFFIX}"

    def announce(self, info: PeerInfo, ttl_s: float) -> None:
        """Write the record atomically (temp file + rename), valid for ``ttl_s``."""
        record = replace(info, expires_at=self._clock() + ttl_s)
        path = self._path(info.name)
        # A random temp name: hosts sharing the directory (NFS) may run writers with the same
        # pid and thread id, which must not write into or rename each other's temp files.
        temp = path.with_name(temp_name(path.name))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            temp.write_text(record.to_json())
            os.replace(temp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)
            raise StoreError(f"cannot write peer registry {self.directory}: {exc}") from None

    def withdraw(self, name: str) -> None:
        """Delete the record."""
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            pass

    def peers(self) -> list[PeerInfo]:
        """Live records. Stale ones are skipped, and removed once long dead."""
        out = []
        try:
            # scandir, not glob: glob swallows a directory it may not read (as empty)
            with os.scandir(self.directory) as entries:
                paths = sorted(
                    Path(e.path)
                    for e in entries
                    if e.name.endswith(_SUFFIX) and not e.name.startswith(".")
                )
        except FileNotFoundError:
            return []  # nobody has announced into it yet
        except OSError as exc:
            raise self._cannot_list(exc) from None
        now = self._clock()
        for path in paths:
            try:
                # at most one byte past the limit; a FIFO (anyone who can write the registry
                # can make one) is refused, never waited on
                record = read_regular(str(path), MAX_RECORD_BYTES + 1)
                if record is None:
                    continue  # withdrawn meanwhile
                info = PeerInfo.from_json(record)
            except (OSError, ValueError, TypeError):
                continue
            if info.expires_at and info.expires_at < now:
                if info.expires_at + self.cleanup_after_s < now:
                    try:
                        path.unlink()
                    except OSError:
                        pass
                continue
            out.append(info)
        return out

    def __repr__(self) -> str:
        return f"FileRegistry({str(self.directory)!r})"


class RedisRegistry:
    """Records as Redis keys ``<prefix><name>`` with a TTL: Redis itself expires dead servers."""

    def __init__(
        self, url: str, *, prefix: str = "chunkstore:peer:", timeout_s: float = 2.0
    ) -> None:
        try:
            import redis
        except ImportError:
            raise MissingDependency(
                "the Redis registry needs redis: pip install 'chunkstore[peer]'"
            ) from None
        self.url = url
        self.prefix = prefix
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._errors = (redis.RedisError, OSError)

    def check(self) -> None:
        """Raise :class:`StoreError` unless Redis answers a PING."""
        try:
            self._redis.ping()
        except self._errors as exc:
            raise StoreError(f"peer registry {self.url}: Redis unreachable ({exc})") from None

    def announce(self, info: PeerInfo, ttl_s: float) -> None:
        """SET the record with an expiry of ``ttl_s`` (rounded up to milliseconds)."""
        record = replace(info, expires_at=time.time() + ttl_s)
        try:
            self._redis.set(self.prefix + info.name, record.to_json(), px=max(1, int(ttl_s * 1000)))
        except self._errors as exc:
            raise StoreError(f"cannot announce to Redis {self.url}: {exc}") from None

    def withdraw(self, name: str) -> None:
        """DEL the record."""
        try:
            self._redis.delete(self.prefix + name)
        except self._errors as exc:
            log.warning("could not withdraw %s from Redis: %s", name, exc)

    def peers(self) -> list[PeerInfo]:
        """Every live record (SCAN, so a large registry does not block Redis)."""
        try:
            names = list(self._redis.scan_iter(match=self.prefix + "*", count=500))
            values = self._redis.mget(names) if names else []
        except self._errors as exc:
            raise StoreError(f"Redis registry {self.url} unreachable: {exc}") from None
        out = []
        for value in values:
            if value is None:
                continue
            try:
                out.append(PeerInfo.from_json(value))
            except (ValueError, TypeError):
                continue
        return sorted(out, key=lambda i: i.name)

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()

    def __repr__(self) -> str:
        return f"RedisRegistry({self.url!r})"


def open_registry(spec: str | os.PathLike[str]) -> Registry:
    """Open a registry by URL.
    ``redis://host:port/db`` opens a :class:`RedisRegistry`.
    A path or ``file://`` opens a :class:`FileRegistry`."""
    text = os.fspath(spec)
    if text.startswith(("redis://", "rediss://", "unix://")):
        return RedisRegistry(text)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if "://" in text:
        raise ConfigError(
            f"unknown registry {text!r}: use a directory, file:///dir or redis://host:port"
        )
    return FileRegistry(text)


class Announcer:
    """Renews a server's registry record every ``interval_s`` until :meth:`stop`."""

    def __init__(
        self,
        registry: Registry,
        info: PeerInfo | Any,
        *,
        interval_s: float = 2.0,
        ttl_s: float | None = None,
    ) -> None:
        """``info`` is a PeerInfo, or a callable returning a fresh one per heartbeat."""
        if interval_s <= 0:
            raise ConfigError("the heartbeat interval must be positive")
        self.registry = registry
        self._info = info
        self.interval_s = interval_s
        self.ttl_s = ttl_s if ttl_s is not None else 3 * interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name: str | None = None

    def _current(self) -> PeerInfo:
        return self._info() if callable(self._info) else self._info

    def beat(self) -> None:
        """Announce once now."""
        info = self._current()
        self._name = info.name
        self.registry.announce(info, self.ttl_s)

    def start(self) -> Announcer:
        """First heartbeat now (errors raise), then in the background."""
        self.beat()
        self._thread = threading.Thread(target=self._run, name="peer-announcer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - keep beating; the registry may come back
                log.warning("peer heartbeat failed: %s", exc)

    def stop(self, *, withdraw: bool = True) -> None:
        """Stop beating and (by default) remove the record."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if withdraw and self._name is not None:
            self.registry.withdraw(self._name)
