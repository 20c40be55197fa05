"""The owner side of TP shard assembly, see :mod:`chunkstore.cache.assembly._assembler`.

The process that owns the host cache lends free slots to the rank processes.
It adopts each sealed chunk into its index exactly once, and queues it for write-back.
It aborts claims that are not sealed in time.
It takes their slots back once no live writer is inside.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from chunkstore.cache._host import HostCache
from chunkstore.cache._pool import ABORTED, CLAIMED, SEALED, SEALING
from chunkstore.cache.assembly._assembler import process_alive, ranks_in, wake_address
from chunkstore.errors import ConfigError
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AssemblyOwnerStats:
    """Counters of an :class:`AssemblyOwner`."""

    published: int
    """Assembled chunks adopted into host memory (each queued for write-back once)."""
    duplicates: int
    """Assembled chunks dropped because the key was already cached."""
    aborted: int
    """Claims aborted by the owner because they were not sealed in time."""
    writers_lost: int
    """Writers found dead inside an aborted claim (their slot was reclaimed anyway)."""
    reclaimed: int
    """Aborted claims whose slot went back on loan."""
    lent: int
    """Slots on loan now (free for claims, claimed, or sealed and not yet adopted)."""


class WritesBack(Protocol):
    """A host cache with write-behind in front of it (a tiered store)."""

    host: HostCache

    def write_back(self, lease: Any) -> None:
        """Queue the chunk in a held slot for the secondary tiers."""


class AssemblyOwner:
    """The owner side of TP shard assembly: lends slots, publishes sealed chunks once.

    ``store`` is a tiered store, or a bare :class:`HostCache`.
    A tiered store is :class:`WritesBack`: adopted chunks are queued for write-back.
    The host cache must be created with ``shm_name``, so rank processes can attach.
    ``lend_slots`` is the free slots kept on loan.
    It is the most chunks ranks can start between two owner passes.
    The default is a quarter of the pool, at most 64.
    ``claim_timeout`` is the seconds after which an unsealed claim is aborted.
    ``sweep_interval`` is the seconds between passes when no rank wakes the owner.
    ``on_publish`` is called with the keys of each pass's new chunks.
    Call :meth:`start` for the background thread, or :meth:`collect` yourself.
    """

    def __init__(
        self,
        store: WritesBack | HostCache,
        *,
        lend_slots: int | None = None,
        claim_timeout: float = 30.0,
        sweep_interval: float = 0.5,
        on_publish: Callable[[list[ChunkKey]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(store, HostCache):
            self.host = store
            self._write_back: Callable[[Any], None] | None = None
        else:
            self.host = store.host
            self._write_back = store.write_back
        if claim_timeout <= 0 or sweep_interval <= 0:
            raise ConfigError("claim_timeout and sweep_interval must be positive")
        default_lend = max(1, min(64, self.host.num_slots // 4))
        self.lend_target = default_lend if lend_slots is None else int(lend_slots)
        """Free slots kept on loan to rank processes."""
        if not 1 <= self.lend_target < self.host.num_slots:
            raise ConfigError(
                f"lend_slots must be in 1..{self.host.num_slots - 1}, got {self.lend_target}"
            )
        self.claim_timeout = claim_timeout
        self.sweep_interval = sweep_interval
        self.on_publish = on_publish
        self._clock = clock
        self.pool = self.host.pool
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("published", "duplicates", "aborted", "writers_lost", "reclaimed"), 0
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.host.loans.lend(self.lend_target)

    def start(self) -> AssemblyOwner:
        """Run :meth:`collect` on a daemon thread, woken by ranks (and every ``sweep_interval``)."""
        if self._thread is not None:
            return self
        if self.pool.name is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(wake_address(self.pool.name))
            except OSError as exc:
                sock.close()
                log.warning(
                    "pool %s: no wake-up socket (%s); sweeping every %.2f s",
                    self.pool.name,
                    exc,
                    self.sweep_interval,
                )
            else:
                sock.setblocking(False)
                self._sock = sock
        self._thread = threading.Thread(
            target=self._run,
            name=f"chunkstore-assembly-{self.pool.name or 'private'}",
            daemon=True,
        )
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wait()
            if self._stop.is_set():
                return
            try:
                self.collect()
            except Exception:  # noqa: BLE001 - the owner thread must outlive any bad pass
                log.exception("shard assembly pass failed")

    def _wait(self) -> None:
        sock = self._sock
        if sock is None:
            self._stop.wait(self.sweep_interval)
            return
        try:
            readable, _, _ = select.select([sock], [], [], self.sweep_interval)
        except (OSError, ValueError):  # closed under us: close() is running
            self._stop.wait(self.sweep_interval)
            return
        if not readable:
            return
        # Many ranks finishing at once send many datagrams: one pass serves them all.
        while True:
            try:
                sock.recv(16)
            except OSError:  # BlockingIOError: drained
                return

    def collect(self) -> list[ChunkKey]:
        """One pass: publish sealed chunks, abort overdue claims, reclaim slots, lend more.

        Returns the keys published by this pass. Each is in host memory.
        Each is queued for write-back when the owner has a tiered store.
        """
        published: list[ChunkKey] = []
        leases: list[Any] = []
        with self._lock:
            host, pool = self.host, self.pool
            with pool:
                if pool.closed:
                    return []
                now = self._clock()
                table = pool.table
                for slot in host.loans.lent():
                    state = int(table["state"][slot])
                    if state == SEALED:
                        adoption = host.loans.adopt(slot, keep_pinned=self._write_back is not None)
                        if adoption.published:
                            published.append(adoption.key)
                            if adoption.lease is not None:
                                leases.append(adoption.lease)
                            self._counts["published"] += 1
                        else:
                            self._counts["duplicates"] += 1
                        continue
                    if state in (CLAIMED, SEALING) and (
                        now - float(table["claimed_at"][slot]) > self.claim_timeout
                    ):
                        table["state"][slot] = state = ABORTED
                        self._counts["aborted"] += 1
                        log.warning(
                            "pool %s: claim on slot %d not sealed within %.1f s "
                            "(ranks joined %s, done %s); aborted",
                            pool.name,
                            slot,
                            self.claim_timeout,
                            ranks_in(int(table["joined"][slot])),
                            ranks_in(int(table["done"][slot])),
                        )
                    if state == ABORTED and self._writers_gone(slot):
                        host.loans.take_back(slot)
                        self._counts["reclaimed"] += 1
                host.loans.lend(self.lend_target)
        for lease in leases:
            assert self._write_back is not None
            self._write_back(lease)
        if published and self.on_publish is not None:
            self.on_publish(published)
        return published

    def _writers_gone(self, slot: int) -> bool:
        """Whether no live writer is inside aborted ``slot`` (dead ones are written off)."""
        entry = self.pool.table[slot]
        inside = int(entry["joined"]) & ~int(entry["done"])
        for rank in ranks_in(inside):
            if not process_alive(int(self.pool.rank_pids[rank])):
                entry["done"] = int(entry["done"]) | (1 << rank)
                inside &= ~(1 << rank)
                self._counts["writers_lost"] += 1
        return inside == 0

    def stats(self) -> AssemblyOwnerStats:
        """A snapshot of the counters."""
        with self._lock:
            counts = dict(self._counts)
        return AssemblyOwnerStats(**counts, lent=len(self.host.loans.lent()))

    def close(self) -> None:
        """Stop the thread after one last pass, so sealed chunks are published. Idempotent.

        Unclaimed loans go back to the cache. Claims still open stay lent.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        if self._sock is not None and self.pool.name is not None:
            try:
                self._sock.sendto(b"!", wake_address(self.pool.name))
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            self.collect()
            self.host.loans.recall()
        except Exception:  # noqa: BLE001 - closing must not fail on a closed store
            log.debug("final assembly pass skipped", exc_info=True)

    def __enter__(self) -> AssemblyOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
