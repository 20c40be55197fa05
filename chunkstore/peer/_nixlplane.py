"""The NIXL (UCX) data plane: host-to-host READs between registered memory regions.

One :class:`NixlEndpoint` wraps one NIXL agent.
The server registers its staging arena and the served object's pool once.
It does so before handing its agent metadata to clients in ``hello``.
The client registers its receive arena and READs straight from the server's memory.
Every transfer has a deadline.
Every NIXL failure becomes ``False``, a miss, never an exception on the serving path.
A transfer still running at its deadline fails, but only once NIXL reports it ended.
Until then UCX may still write into or read from the local memory.
The caller frees or reuses that memory as soon as we return.

For the same reason a peer's agent is not removed while a transfer with it runs.
NIXL would fail that transfer at once, "invalidated during transfer".
Releasing it does not stop the RMA that UCX already posted.
With UCX over TCP the bytes kept arriving after the release.
The removal waits for the last such transfer to end.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


def address_of(buffer: Any) -> tuple[int, int]:
    """(address, length) of a contiguous buffer, without copying it: what NIXL registers
    and reads."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return int(array.ctypes.data), int(array.nbytes)


_unavailable_reason: str | None = None
_checked = False
_check_lock = threading.Lock()


def nixl_unavailable_reason() -> str | None:
    """``None`` when NIXL with the UCX backend can be used here, else why not (one line)."""
    global _checked, _unavailable_reason
    with _check_lock:
        if _checked:
            return _unavailable_reason
        _checked = True
        if os.environ.get("CHUNKSTORE_PEER_DISABLE_NIXL"):
            _unavailable_reason = "disabled by CHUNKSTORE_PEER_DISABLE_NIXL"
            return _unavailable_reason
        try:
            _quiet_nixl_logs()
            from nixl._api import nixl_agent  # noqa: F401

            logging.getLogger("nixl").setLevel(logging.WARNING)
        except Exception as exc:  # ImportError, or a broken native library (OSError)
            _unavailable_reason = (
                f"nixl is not importable ({type(exc).__name__}: {exc}); "
                "pip install 'chunkstore[nixl]'"
            )
        return _unavailable_reason


def _quiet_nixl_logs() -> None:
    # NIXL logs every agent creation at INFO on stdout, which would corrupt `--json` output.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def _agent_name(role: str) -> str:
    return f"chunkstore-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _make_agent(name: str, progress_delay_us: int) -> Any:
    """A NIXL agent with the UCX backend and a progress thread that sleeps between passes."""
    import nixl._api as api

    config = api.nixl_agent_config(
        enable_prog_thread=True,
        backends=["UCX"],
        # Several threads (server workers, parallel peer clients) share one agent.
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    bindings = api.nixlBind
    base = bindings.nixlAgentConfig
    try:

        class _DelayedConfig(base):  # type: ignore[misc, valid-type]
            # nixl_agent.__init__ assigns pthrDelay = 0; keep ours instead.
            @property
            def pthrDelay(self) -> int:  # noqa: N802 - the binding's name
                return int(base.pthrDelay.__get__(self))

            @pthrDelay.setter
            def pthrDelay(self, _value: int) -> None:  # noqa: N802
                base.pthrDelay.__set__(self, progress_delay_us)

        class _Bindings:
            nixlAgentConfig = _DelayedConfig  # noqa: N815

            def __getattr__(self, attribute: str) -> Any:
                return getattr(bindings, attribute)

    except Exception:  # noqa: BLE001 - a changed binding: accept NIXL's busy progress thread
        return api.nixl_agent(name, config)
    with _agent_patch_lock:
        api.nixlBind = _Bindings()
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind = bindings


_agent_patch_lock = threading.Lock()


class NixlEndpoint:
    """One NIXL agent with its registered regions and the remote agents it knows."""

    def __init__(self, role: str, *, progress_delay_us: int | None = None) -> None:
        """Start a NIXL agent for ``role``.

        ``progress_delay_us`` is the pause of NIXL's UCX progress thread between passes.
        NIXL's Python API hard-codes 0, a busy loop that burns a whole core per agent.
        The target side must progress for connection set-up and for RMA emulated over TCP.
        So the thread stays, but sleeps.
        The default is $CHUNKSTORE_PEER_NIXL_PROGRESS_US, else 200 us."""
        if progress_delay_us is None:
            progress_delay_us = int(os.environ.get("CHUNKSTORE_PEER_NIXL_PROGRESS_US", "200"))
        reason = nixl_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.name = _agent_name(role)
        self._agent = _make_agent(self.name, progress_delay_us)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("the NIXL UCX backend could not be created")
        self._regions: list[tuple[int, int, Any]] = []  # (address, size, reg descs)
        self._remotes: dict[str, int] = {}
        self._running: dict[str, int] = {}  # transfers in progress per remote agent
        self._unwanted: set[str] = set()  # agents to remove once their transfers end
        self._closed = False  # closed: the last running transfer deregisters the memory
        self._lock = threading.Lock()
        self._leaked: list[Any] = []  # transfer handles NIXL refused to release

    # --- registration -------------------------------------------------------------

    def register(self, buffer: Any) -> None:
        """Register a buffer for transfers: a numpy array, memoryview or mmap. It must not move."""
        address, size = address_of(buffer)
        with self._lock:
            if any(a <= address and address + size <= a + s for a, s, _ in self._regions):
                return
            descs = self._agent.register_memory([(address, size, 0, "")], "DRAM")
            self._regions.append((address, size, descs))

    def registered(self, address: int, size: int) -> bool:
        """Whether ``[address, address+size)`` lies in one registered region."""
        return any(a <= address and address + size <= a + s for a, s, _ in self._regions)

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered regions) for a peer."""
        return bytes(self._agent.get_agent_metadata())

    # --- remote agents ------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str | None:
        """Load a peer's metadata. Returns its agent name.
        Returns ``None`` if NIXL rejects it, or if the endpoint is closed.
        A late caller would otherwise start transfers after close()."""
        with self._lock:  # not between another thread's removal decision and its removal
            if self._closed:
                return None
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001 - malformed metadata from a peer is a refusal
                log.warning("NIXL rejected a peer's metadata: %s", exc)
                return None
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._remotes[name] = self._remotes.get(name, 0) + 1
            self._unwanted.discard(name)  # wanted again before its deferred removal ran
        return name

    def remove_remote(self, name: str) -> None:
        """Let go of one use of a peer's agent.
        Each :meth:`add_remote` is one use: a client's hold, or a server's session.
        Clients sharing a plane may load the same server's agent.
        So it is removed only after its last user lets go.
        Even then it waits until no transfer with it is running, see the module docstring."""
        with self._lock:
            count = self._remotes.get(name, 0) - 1
            if count > 0:
                self._remotes[name] = count
                return
            if self._remotes.pop(name, None) is not None:
                self._remove_when_idle(name)

    def _remove_when_idle(self, name: str) -> None:
        """Remove the agent ``name`` (no longer used) now, or, while transfers with it run,
        when the last of them ends. Caller holds the lock."""
        if self._running.get(name):
            self._unwanted.add(name)
        else:
            self._remove_agent(name)

    def _remove_agent(self, name: str) -> None:
        """Caller holds the lock: no transfer with ``name`` starts until it is gone."""
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("removing NIXL agent %s: %s", name, exc)

    # --- transfers ------------------------------------------------------------------

    def read(self, remote: str, pairs: Sequence[tuple[int, int, int]], deadline: float) -> bool:
        """READ each ``(local_address, remote_address, size)`` from ``remote``.
        True when all bytes arrived before ``deadline``, a ``time.monotonic()`` value.
        Never returns while the transfer may still write into the local memory.
        See the module docstring."""
        return self._transfer("READ", remote, pairs, deadline)

    def write(self, remote: str, pairs: Sequence[tuple[int, int, int]], deadline: float) -> bool:
        """WRITE each ``(local_address, remote_address, size)`` to ``remote``."""
        return self._transfer("WRITE", remote, pairs, deadline)

    def _transfer(
        self, op: str, remote: str, pairs: Sequence[tuple[int, int, int]], deadline: float
    ) -> bool:
        if not pairs:
            return True
        with self._lock:
            if remote not in self._remotes:  # removed (or removal pending): NIXL may fail it
                return False
            self._running[remote] = self._running.get(remote, 0) + 1
        try:
            return self._run(op, remote, pairs, deadline)
        finally:
            with self._lock:
                left = self._running[remote] - 1
                if left:
                    self._running[remote] = left
                else:
                    del self._running[remote]
                    if remote in self._unwanted:
                        self._unwanted.discard(remote)
                        self._remove_agent(remote)
                    if self._closed and not self._running:
                        self._deregister_all()

    def _run(
        self, op: str, remote: str, pairs: Sequence[tuple[int, int, int]], deadline: float
    ) -> bool:
        """One transfer, which the caller counts as running with ``remote``."""
        agent = self._agent
        handle = None
        try:
            local = agent.get_xfer_descs([(la, n, 0) for la, _, n in pairs], "DRAM")
            far = agent.get_xfer_descs([(ra, n, 0) for _, ra, n in pairs], "DRAM")
            handle = agent.initialize_xfer(op, local, far, remote)
            state = agent.transfer(handle)
            spins = 0
            overdue = False
            while state == "PROC":
                if not overdue and time.monotonic() > deadline:
                    # Returning now would hand the local memory back to its owner (an arena
                    # block, a host-cache slot) while UCX may still write into it (READ) or
                    # read from it (WRITE): releasing a handle does not stop an RMA already
                    # posted. So the transfer fails, but only once NIXL says it has ended; a
                    # caller that must not wait that long runs us under its own timeout and
                    # keeps the memory pinned until we return (chunkstore.tiering._guard).
                    log.warning(
                        "NIXL %s with %s passed its deadline; failing it once it ends", op, remote
                    )
                    overdue = True
                spins += 1
                if spins > 200:  # spin briefly, then yield: UCX progresses on its own thread
                    time.sleep(0.0002 if not overdue else 0.002)
                state = agent.check_xfer_state(handle)
            if overdue:
                # Late data may come from memory the peer reused after our lease ended.
                self._discard(handle)
                return False
            if state != "DONE":
                if state == "ERR":
                    log.warning("NIXL %s from %s failed", op, remote)
                self._discard(handle)
                return False
            handle.release()
            return True
        except Exception as exc:  # noqa: BLE001 - any NIXL error (disconnect, not found) is a miss
            log.warning("NIXL %s from %s failed: %s", op, remote, exc)
            if handle is not None:
                self._discard(handle)
            return False

    def _discard(self, handle: Any) -> None:
        try:
            handle.release()  # cancels the transfer where the backend can
        except Exception:  # noqa: BLE001 - keep it referenced so NIXL never frees it twice
            self._leaked.append(handle)

    def close(self) -> None:
        """Deregister everything. The endpoint is unusable afterwards.
        A transfer still running keeps its peer's agent and the registered memory until it ends.
        The last one finishes the close.
        Removing either under it would let UCX write on unseen."""
        with self._lock:
            self._closed = True
            for name in list(self._remotes):
                del self._remotes[name]
                self._remove_when_idle(name)
            if not self._running:
                self._deregister_all()

    def _deregister_all(self) -> None:
        """Caller holds the lock."""
        regions, self._regions = self._regions, []
        for _, _, descs in regions:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001
                pass
