"""Byte cap for a filesystem store: LRU eviction, shared by every writer process.

The design is in spec/FORMAT.md, "Capacity".
A usage ledger ``.chunkstore/usage.json`` holds the bytes and chunk count of published chunks.
Every capped writer takes the store's lock file with ``flock``.
It holds it around *account, evict, publish, record*.
So the check and the rename are one step for all processes, and usage never exceeds the cap.
Temp files in flight are not chunks and are not counted.
The chunk data itself is written before the lock is taken.
So writers only serialise on a rename and a ledger update.

The ledger is a hint that may drift, after a crash past publish or an ``rm`` by hand.
A missing or unreadable ledger triggers a recount under the lock.
Every eviction scan replaces it with the exact count.
So does an admit whose candidates turn out to be gone.
The ledger then counted files that are no longer there.
A store without a cap keeps an existing ledger true through a ledger-only limiter.
That is ``max_bytes=None``: the same lock and bookkeeping, and no eviction.
The list of eviction candidates is an in-process cache of the last scan.
It is no index that a fresh process would lack.
Each candidate is re-checked on disk before it is deleted, and one recently read is skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Keep at most this many eviction candidates between scans (the oldest ones).
MAX_CANDIDATES = 65536

#: Recount when this many candidates of one admit were found gone: files vanished behind
#: the ledger's back, so it overstates usage and would evict chunks that need not go.
RECOUNT_AFTER_GONE = 4


@dataclass(slots=True)
class Usage:
    """Published chunk bytes and count, as the ledger records them."""

    bytes: int
    """Sum of chunk sizes."""
    chunks: int
    """Number of chunks."""


def _count(value: Any) -> int | None:
    """``value`` if it is a non-negative JSON integer (not a bool, float or string), else None."""
    return value if type(value) is int and value >= 0 else None


def _parse_ledger(raw: bytes) -> tuple[Usage, int | None] | None:
    """The usage and recorded cap in a ledger, or None if it is not one this code wrote.

    Anything else is unreadable and recounted.
    That is a torn write, a list, ``1e999``, or a negative or fractional count.
    A ledger believed negative would let the store pass its cap.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(doc, dict):
        return None
    size, chunks = _count(doc.get("bytes")), _count(doc.get("chunks"))
    if size is None or chunks is None:
        return None
    return Usage(size, chunks), _count(doc.get("max_bytes"))


class CapacityLimiter:
    """Serialises publishes of one store root and evicts least-recently-used chunks.

    ``max_bytes=None`` keeps the ledger only.
    That is for a store without a cap writing into a capped store's root.
    Nothing is evicted, and the recorded cap is kept.

    ``scan()`` yields ``(path, size, access_time)`` for every chunk.
    ``probe(path)`` returns the current ``(size, access_time)``, or None.
    ``evict(path)`` deletes a chunk and its access record.
    It returns the chunk's size, or 0.
    """

    def __init__(
        self,
        io: Any,
        state_dir: str,
        max_bytes: int | None,
        *,
        scan: Callable[[], Iterable[tuple[str, int, float]]],
        probe: Callable[[str], tuple[int, float] | None],
        evict: Callable[[str], int],
    ) -> None:
        self.io = io
        self.max_bytes = max_bytes
        self.lock_path = io.join(state_dir, "lock")
        self.ledger_path = io.join(state_dir, "usage.json")
        self._scan = scan
        self._probe = probe
        self._evict = evict
        self._candidates: deque[tuple[float, str]] = deque()
        self._gone = 0
        self._recorded_cap: int | None = None
        self.evicted = 0
        """Chunks this process evicted."""

    # --- ledger ------------------------------------------------------------------

    def _load(self) -> Usage:
        try:
            raw = self.io.read_small(self.ledger_path)
        except OSError as exc:  # a FIFO or directory at its name, EACCES: unreadable too
            log.warning("capacity ledger %s unreadable (%s); recounting", self.ledger_path, exc)
            return self._recount()
        if raw is not None:
            parsed = _parse_ledger(raw)
            if parsed is not None:
                usage, self._recorded_cap = parsed
                return usage
            log.warning("capacity ledger %s unreadable; recounting", self.ledger_path)
        return self._recount()

    def _save(self, usage: Usage) -> None:
        doc = {
            "bytes": max(usage.bytes, 0),
            "chunks": max(usage.chunks, 0),
            "max_bytes": self.max_bytes if self.max_bytes is not None else self._recorded_cap,
            "updated": round(time.time(), 3),
        }
        self.io.write_small(self.ledger_path, json.dumps(doc).encode())

    def _recount(self) -> Usage:
        """Exact usage from a full scan; refreshes eviction candidates (caller holds the lock)."""
        entries = list(self._scan())
        usage = Usage(sum(size for _, size, _ in entries), len(entries))
        oldest = sorted((atime, path) for path, _, atime in entries)[:MAX_CANDIDATES]
        self._candidates = deque(oldest)
        return usage

    # --- public ------------------------------------------------------------------

    def usage(self) -> Usage:
        """Current ledger (recounted if missing)."""
        with self.io.lock(self.lock_path):
            usage = self._load()
            self._save(usage)
            return usage

    def recount(self) -> Usage:
        """Rebuild the ledger from a full scan."""
        with self.io.lock(self.lock_path):
            usage = self._recount()
            self._save(usage)
            return usage

    def admit(self, final: str, size: int, publish: Callable[[], bool], *, replace: bool) -> bool:
        """Make room for ``size`` bytes at ``final`` and call ``publish`` under the lock.

        Returns what ``publish`` returned.
        Returns False when one chunk is larger than the cap.
        With ``replace=False`` it returns False too when ``final`` already exists.
        """
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning(
                "chunk of %d bytes exceeds the store cap of %d; not stored", size, self.max_bytes
            )
            return False
        with self.io.lock(self.lock_path):
            old = self.io.stat(final)
            if old is not None and not replace:
                return False
            old_size = old.size if old is not None else 0
            usage = self._load()
            rescanned = False
            self._gone = 0
            cap = self.max_bytes
            while cap is not None and usage.bytes - old_size + size > cap:
                victim = self._next_victim(final)
                if victim is None or (self._gone >= RECOUNT_AFTER_GONE and not rescanned):
                    if rescanned:
                        break  # nothing left to evict: the ledger is exact, so this fits
                    usage = self._recount()
                    rescanned = True
                    continue
                freed = self._evict(victim)
                if freed:
                    usage.bytes -= freed
                    usage.chunks -= 1
                    self.evicted += 1
            written = publish()
            if written:
                usage.bytes += size - old_size
                usage.chunks += 0 if old is not None else 1
            self._save(usage)
            return written

    def removed(self, remove: Callable[[], Sequence[tuple[str, int]]]) -> None:
        """Run ``remove`` under the lock and update the ledger.
        ``remove`` returns the path and size of each chunk it deleted."""
        with self.io.lock(self.lock_path):
            usage = self._load()
            sizes = [size for _, size in remove()]
            usage.bytes -= sum(sizes)
            usage.chunks -= len(sizes)
            self._save(usage)

    def _next_victim(self, protect: str) -> str | None:
        while self._candidates:
            atime, path = self._candidates.popleft()
            if path == protect:
                continue
            now = self._probe(path)
            if now is None:
                self._gone += 1  # another process evicted or deleted it
                continue
            if now[1] > atime + 1e-3:
                continue  # read since the scan: no longer least recently used
            return path
        return None
