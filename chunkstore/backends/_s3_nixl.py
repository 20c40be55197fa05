"""The NIXL OBJ data path of the S3 store: ``S3Store(..., data_path="nixl")``.

Deployments that already run NIXL can move chunk bytes through NIXL's OBJ backend.
That backend is the AWS C++ SDK, used instead of s3fs.
A WRITE is one PUT of a registered host buffer.
A READ is a ranged GET straight into one.
Object names and bytes are the S3 store's, so either data path reads what the other wrote.

Only the bytes move here.
Listing, HEAD, delete, the layout marker and access records stay on s3fs.
So do quarantine and conditional writes with ``If-None-Match``.
NIXL's OBJ backend can do none of them, as its PUT carries no conditions.

How NIXL OBJ addresses objects:
an ``OBJ`` registration ``(0, size, devId, object_name)`` maps ``devId`` to the object.
A transfer descriptor ``(offset, length, devId)`` on the remote side then names bytes of it.
The local side is a registered ``DRAM`` range.
Its GET is a ranged GET of exactly ``length`` bytes, and does not report how many arrived.
A short object leaves the rest of the buffer untouched.
So every read first learns the object's size from a HEAD over s3fs, and asks for that.

Each transfer is waited for until NIXL reports it finished.
The AWS SDK may still write into or read from the buffer until then.
A transfer stalled past ``stall_limit`` is abandoned only when its buffer is ours.
That buffer then stays referenced for good.
One with a caller's buffer, such as a host-cache slot, is waited for however long it takes.
The caller reuses that memory as soon as we return.
A caller that cannot wait runs us under its own timeout.
It keeps the slot pinned until we return, see ``chunkstore.tiering._guard``.
Retries and timeouts are the SDK's.
``AWS_RETRY_MODE`` and ``AWS_MAX_ATTEMPTS`` bound them, see :func:`_sdk_retry_env`.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from chunkstore.errors import ConfigError, MissingDependency, StoreError

log = logging.getLogger(__name__)

SizeLookup = Callable[[Sequence[str]], "list[int | None]"]
"""Object sizes by name (``None``: missing or unreadable), from one batch of HEADs."""

_env_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class NixlObjConfig:
    """Where and how NIXL's OBJ backend reaches the bucket."""

    bucket: str
    """The S3 bucket (the store's prefix is part of each object name)."""
    region: str
    """Region the requests are signed for."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (``http://127.0.0.1:9000``); ``None``: AWS for ``region``."""
    credentials: tuple[str, str, str | None] | None = None
    """(access key, secret, session token) the s3fs client resolved; ``None``: the SDK's chain."""
    max_attempts: int = 5
    """Attempts per request, retries included (the SDK's standard retry mode)."""
    threads: int = 8
    """Requests in flight: the backend runs each one on a thread of its own pool."""
    params: Mapping[str, str] = field(default_factory=dict)
    """Raw OBJ backend parameters, applied last (``req_checksum``, ``ca_bundle``, ...)."""

    def backend_params(self) -> dict[str, str]:
        """The ``createBackend("OBJ", ...)`` parameters."""
        out = {
            "bucket": self.bucket,
            "region": self.region,
            "num_threads": str(max(1, self.threads)),
        }
        if self.endpoint_url:
            parts = urlsplit(self.endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(
                    f"endpoint_url must be http(s)://host[:port], got {self.endpoint_url!r}"
                )
            out["endpoint_override"] = self.endpoint_url
            out["scheme"] = parts.scheme
            # S3-compatible servers (MinIO, Ceph, moto) are addressed path-style.
            out["use_virtual_addressing"] = "false"
        else:
            out["use_virtual_addressing"] = "true"
        if self.credentials is not None:
            access, secret, token = self.credentials
            out["access_key"], out["secret_key"] = access, secret
            if token:
                out["session_token"] = token
        for name, value in self.params.items():
            if not isinstance(name, str) or not isinstance(value, str):
                raise ConfigError(
                    f"nixl_params must map strings to strings, got {name!r}: {value!r}"
                )
            out[name] = value
        return out


@dataclass(slots=True)
class _Transfer:
    """One posted NIXL transfer and everything that must outlive it."""

    name: str
    buffer: Any
    """The host buffer (kept referenced until NIXL is done with it)."""
    handle: Any = None
    registrations: list[Any] = field(default_factory=list)
    state: str = "PROC"
    agent: Any = None
    """The agent that posted it.
    The transfer is waited on and released through it, even after
    :meth:`NixlObjDataPath.close` dropped the path's own reference.
    Otherwise a running transfer would turn into a miss while the SDK still touches the
    caller's buffer."""


def _import_nixl() -> Any:
    # NIXL logs every agent and backend creation at INFO on stdout, which would corrupt
    # `--json` output; its errors still reach stderr.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl._api as api
    except Exception as exc:  # ImportError, or a broken native library (OSError)
        raise MissingDependency(
            f"data_path='nixl' needs NIXL ({type(exc).__name__}: {exc}): "
            "pip install 'chunkstore[nixl]'"
        ) from None
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return api


@contextmanager
def _sdk_retry_env(max_attempts: int) -> Iterator[None]:
    """Bound the AWS C++ SDK's retries while NIXL builds its S3 client.

    NIXL's OBJ backend has no retry or timeout parameter.
    The SDK's legacy default retries 10 times with backoff before a call fails.
    The SDK reads ``AWS_RETRY_MODE`` and ``AWS_MAX_ATTEMPTS`` when the client is built.
    They are set for that moment only, unless the user already set them.
    The process environment is shared: the lock keeps two stores from interleaving.
    The window is the backend creation only.
    """
    wanted = {"AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": str(max_attempts)}
    with _env_lock:
        added = [name for name in wanted if name not in os.environ]
        for name in added:
            os.environ[name] = wanted[name]
        try:
            yield
        finally:
            for name in added:
                os.environ.pop(name, None)


def _address(buffer: Any) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class NixlObjDataPath:
    """Chunk bytes between host memory and S3 objects through one NIXL agent's OBJ backend.

    Thread-safe: the agent serialises its own calls (``NIXL_THREAD_SYNC_STRICT``).
    Every failure is a ``None``/``False`` per item and a log line, never an exception.
    """

    def __init__(
        self,
        config: NixlObjConfig,
        sizes: SizeLookup,
        *,
        where: str,
        probe_name: str,
        stall_limit: float = 120.0,
    ) -> None:
        """Set up the path.

        ``sizes`` is the store's HEAD batch.
        ``where`` is the store URL for messages.
        ``probe_name`` is an object under the store's prefix that the open check HEADs.
        It may be present or not.
        ``stall_limit`` is in seconds.
        Past it, a transfer NIXL never finished is abandoned if its buffer is this path's own.
        That buffer stays referenced for good, so no memory is reused under it.
        A transfer with a caller's buffer is waited for on."""
        api = _import_nixl()
        self.config = config
        self.where = where
        self._sizes = sizes
        self._stall_limit = stall_limit
        self.failed_transfers = 0
        """Transfers that failed (each one a miss or an unwritten chunk)."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._abandoned: list[_Transfer] = []
        self._empty = np.zeros(1, dtype=np.uint8)  # a registrable address for 0-byte transfers
        self.name = f"chunkstore-s3-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        params = config.backend_params()
        try:
            # No progress thread: OBJ completes through the SDK's callbacks on its own pool,
            # and NIXL's Python API would make that thread a busy loop (pthrDelay = 0).
            agent_config = api.nixl_agent_config(
                enable_prog_thread=False,
                backends=[],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
            )
            self._agent = api.nixl_agent(self.name, agent_config)
        except Exception as exc:  # noqa: BLE001 - binding errors have no common base
            raise StoreError(f"{where}: cannot create a NIXL agent: {exc}") from None
        if "OBJ" not in self._agent.get_plugin_list():
            raise StoreError(
                f"{where}: NIXL has no OBJ plugin here (plugins found: "
                f"{', '.join(self._agent.get_plugin_list()) or 'none'}; "
                f"NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR', '(unset)')})"
            )
        try:
            with _sdk_retry_env(config.max_attempts):
                self._agent.create_backend("OBJ", params)
        except Exception as exc:  # noqa: BLE001
            raise StoreError(
                f"{where}: NIXL's OBJ backend rejected its parameters "
                f"({type(exc).__name__}: {exc}; NIXL's log on stderr says which)"
            ) from None
        self._probe(probe_name, params)

    def _probe(self, name: str, params: Mapping[str, str]) -> None:
        """One HEAD through NIXL's own S3 client, so that an endpoint, credentials or bucket
        it cannot use fail here, once, rather than as a miss on every read."""
        try:
            self._agent.query_memory([(0, 1, 0, name)], "OBJ", "OBJ")
        except Exception as exc:  # noqa: BLE001
            endpoint = params.get("endpoint_override") or f"AWS ({params.get('region')})"
            raise StoreError(
                f"{self.where}: NIXL's OBJ backend cannot use bucket {self.config.bucket!r} "
                f"at {endpoint} although s3fs can ({type(exc).__name__}: {exc}; NIXL's log "
                "on stderr has the SDK's reason); check nixl_params, or use data_path='s3fs'"
            ) from None

    # --- reads ---------------------------------------------------------------------------

    def read_many(self, names: Sequence[str]) -> list[bytearray | None]:
        """Each object's bytes in a new buffer; ``None`` where missing or failed."""
        sizes = self._sizes(names)
        out: list[bytearray | None] = [None] * len(names)
        jobs: list[tuple[int, str, bytearray]] = []
        for i, (name, size) in enumerate(zip(names, sizes)):
            if size is None:
                continue
            buffer = bytearray(size)
            if size == 0:
                out[i] = buffer
            else:
                jobs.append((i, name, buffer))
        done = self._transfer("READ", [(name, buf, 0) for _, name, buf in jobs], ours=True)
        for (i, _, buffer), ok in zip(jobs, done):
            if ok:
                out[i] = buffer
        return out

    def read_into(self, name: str, view: memoryview) -> int | None:
        """Read one object into the start of ``view`` (writable, bytes); its size, or None.

        Raises ConfigError when the object is larger than ``view``."""
        size = self._sizes([name])[0]
        if size is None:
            return None
        if size > len(view):
            raise ConfigError(f"buffer of {len(view)} bytes is smaller than the chunk ({size})")
        if size == 0:
            return 0
        return size if self._transfer("READ", [(name, view[:size], 0)], ours=False)[0] else None

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytearray] | None:
        """``(offset, length)`` ranges of one object; None if it is missing, shorter than a
        range asks, or a transfer failed."""
        size = self._sizes([name])[0]
        if size is None or any(o < 0 or n < 0 or o + n > size for o, n in ranges):
            return None
        parts = [bytearray(n) for _, n in ranges]
        jobs = [(name, part, o) for part, (o, n) in zip(parts, ranges) if n > 0]
        return parts if all(self._transfer("READ", jobs, ours=True)) else None

    # --- writes --------------------------------------------------------------------------

    def write_many(self, items: Sequence[tuple[str, Any]]) -> list[bool]:
        """PUT each ``(object name, contiguous buffer)`` whole; True per object written."""
        return self._transfer(
            "WRITE", [(name, memoryview(data).cast("B"), 0) for name, data in items], ours=False
        )

    # --- transfers -----------------------------------------------------------------------

    def _transfer(self, op: str, jobs: Sequence[tuple[str, Any, int]], *, ours: bool) -> list[bool]:
        """Post one NIXL request per ``(object name, buffer, object offset)``, then wait for all.

        So one failure is that item's alone.
        ``ours`` says the buffers are this call's own.
        A stalled transfer may then be abandoned with them, see the module docstring.
        Otherwise it is waited for until NIXL reports it finished."""
        posted = [self._post(op, name, buffer, offset) for name, buffer, offset in jobs]
        self._wait(posted, may_abandon=ours)
        results = []
        for transfer in posted:
            ok = transfer.state == "DONE"
            if not ok:
                self.failed_transfers += 1
                log.warning(
                    "%s: NIXL OBJ %s of %s failed (%s)",
                    self.where,
                    op,
                    transfer.name,
                    transfer.state,
                )
            if transfer.state != "PROC":
                self._release(transfer)
            results.append(ok)
        return results

    def _post(self, op: str, name: str, buffer: Any, offset: int) -> _Transfer:
        agent = self._agent
        transfer = _Transfer(name, buffer, agent=agent)
        length = len(buffer)
        with self._lock:
            dev_id = next(self._ids)  # the OBJ backend maps devId -> object name
        address = _address(buffer) if length else _address(self._empty)
        try:
            transfer.registrations.append(
                agent.register_memory([(address, max(length, 1), 0, "")], "DRAM", backends=["OBJ"])
            )
            transfer.registrations.append(
                agent.register_memory(
                    [(0, max(offset + length, 1), dev_id, name)], "OBJ", backends=["OBJ"]
                )
            )
            transfer.handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs([(address, length, 0)], "DRAM"),
                agent.get_xfer_descs([(offset, length, dev_id)], "OBJ"),
                self.name,
            )
            transfer.state = agent.transfer(transfer.handle)
        except Exception as exc:  # noqa: BLE001 - NIXL errors (nixlBackendError, ...) = failure
            transfer.state = f"ERR: {type(exc).__name__}: {exc}"
        return transfer

    def _wait(self, posted: Sequence[_Transfer], *, may_abandon: bool) -> None:
        started = time.monotonic()
        pause = 0.0001
        stalled = False
        while True:
            pending = [t for t in posted if t.state == "PROC"]
            if not pending:
                return
            if not stalled and time.monotonic() - started > self._stall_limit:
                stalled = True
                if may_abandon:
                    with self._lock:
                        self._abandoned.extend(pending)  # the SDK may still touch their buffers
                    log.error(
                        "%s: %d NIXL OBJ transfers unfinished after %.0f s; abandoned "
                        "with their buffers",
                        self.where,
                        len(pending),
                        self._stall_limit,
                    )
                    return
                # The SDK may still write into (or read from) the caller's memory, which
                # the caller reuses once we return: no give-up is safe here.
                log.error(
                    "%s: %d NIXL OBJ transfers with the caller's memory unfinished after "
                    "%.0f s; still waiting for them",
                    self.where,
                    len(pending),
                    self._stall_limit,
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.002)  # the SDK completes on its own threads: just look
            for t in pending:
                try:
                    t.state = t.agent.check_xfer_state(t.handle)
                except Exception as exc:  # noqa: BLE001 - an ERR status raises here
                    t.state = f"ERR: {type(exc).__name__}: {exc}"

    def _release(self, transfer: _Transfer) -> None:
        try:
            if transfer.handle is not None:
                transfer.handle.release()
            for registration in reversed(transfer.registrations):
                transfer.agent.deregister_memory(registration, backends=["OBJ"])
        except Exception:  # noqa: BLE001 - keep what NIXL would not free rather than free twice
            log.debug("%s: releasing a NIXL transfer failed", self.where, exc_info=True)
            with self._lock:
                self._abandoned.append(transfer)
        transfer.registrations.clear()

    def close(self) -> None:
        """Drop the agent (its destructor stops the SDK's thread pool). Transfers still
        running keep it until they end: their callers still wait for them."""
        self._agent = None

    def __repr__(self) -> str:
        return f"NixlObjDataPath({self.where!r}, agent={self.name!r})"


__all__ = ["NixlObjConfig", "NixlObjDataPath", "SizeLookup"]
