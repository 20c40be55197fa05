"""The connector's view of storage: host memory first, then secondary tiers.

This module only composes the public core API (``open_store``, the ``Store``
interface, the format's ``recompress``). What it needs and does not find in
the core yet (a shared, fixed-slot host pool; a ``TieredStore`` with
write-behind) is stood in for by the smallest thing that works in one
process: :class:`_HostMemory`, a byte-bounded LRU of whole chunks. See
``/work/notes/vllm-needs.md``.

Every chunk reaches a device through host memory: a secondary-tier hit is
first prefetched into host memory (:meth:`ConnectorStore.prefetch`), and only
then does the scheduler let vLLM allocate device blocks for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from chunkstore.backends import Store, open_store
from chunkstore.errors import ChunkStoreError, FormatError
from chunkstore.format import ChunkLayout, read_header, recompress
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)

__all__ = ["ConnectorStore", "PrefetchResult", "flush_shared", "release_shared", "shared_store"]


class _HostMemory:
    """Byte-bounded LRU of whole chunks in this process (stand-in for the core HostCache)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._items: OrderedDict[ChunkKey, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: ChunkKey) -> Any | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    @contextmanager
    def read(self, key: ChunkKey) -> Iterator[Any | None]:
        # The bytes object stays valid even if evicted meanwhile: no pin needed.
        yield self.get(key)

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._items

    def close(self) -> None:
        self.clear()

    def put(self, key: ChunkKey, data: Any) -> bool:
        size = len(memoryview(data).cast("B"))
        if size > self.capacity:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.used -= len(memoryview(old).cast("B"))
            while self._items and self.used + size > self.capacity:
                _, evicted = self._items.popitem(last=False)
                self.used -= len(memoryview(evicted).cast("B"))
            self._items[key] = data
            self.used += size
        return True

    def delete(self, key: ChunkKey) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.used -= len(memoryview(old).cast("B"))

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.used = 0

    def __len__(self) -> int:
        return len(self._items)


class _HostCacheTier:
    """The core :class:`~chunkstore.cache.HostCache` (slot pool, ARC/LRU), same methods."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def get(self, key: ChunkKey) -> Any | None:
        return self.cache.get_many([key])[0]

    @contextmanager
    def read(self, key: ChunkKey) -> Iterator[Any | None]:
        lease = self.cache.acquire(key)  # pinned: the policy cannot evict it while we copy
        if lease is None:
            yield None
            return
        try:
            yield lease.view
        finally:
            self.cache.release(lease)

    def contains(self, key: ChunkKey) -> bool:
        return self.cache.exists_many([key])[0]

    def put(self, key: ChunkKey, data: Any) -> bool:
        return bool(self.cache.put_many([(key, data)])[0])

    def delete(self, key: ChunkKey) -> None:
        self.cache.delete_many([key])

    def clear(self) -> None:
        self.cache.delete_many([info.key for info in self.cache.list()])

    def close(self) -> None:
        self.cache.close()

    def __len__(self) -> int:
        return int(self.cache.stats().chunks)


@dataclass
class PrefetchResult:
    """What a prefetch brought into host memory."""

    fetched: int = 0
    """How many chunks (from the first key asked for) are now in host memory."""
    sources: list[str] = field(default_factory=list)
    """Tier kind each fetched chunk came from (``fs``, ``s3``, ``peer``, ...)."""
    corrupt: int = 0
    """Corrupt chunks found (and quarantined by the tier) on the way."""
    error: str | None = None
    """Why the prefetch stopped early, if a tier failed."""


class ConnectorStore:
    """Host memory plus secondary tiers, as the connector uses them.

    Thread-safe. Writes to secondary tiers happen behind the caller's back
    (write-behind) on a small thread pool; :meth:`flush` waits for them.
    """

    def __init__(
        self,
        *,
        host_bytes: int,
        tiers: Sequence[str] = (),
        store_options: dict[str, dict[str, Any]] | None = None,
        compression: str = "none",
        stores: Sequence[Store] | None = None,
        layout: ChunkLayout | None = None,
        policy: str = "arc",
    ) -> None:
        self.host: Any = _host_tier(host_bytes, layout, policy)
        options = store_options or {}
        self.tiers: list[Store] = (
            list(stores)
            if stores is not None
            else [open_store(u, **options.get(u, {})) for u in tiers]
        )
        self.compression = compression
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunkstore-vllm")
        self._pending: set[Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self.write_errors = 0
        self.closed = False

    # --- lookups -------------------------------------------------------------

    def host_run(self, keys: Sequence[ChunkKey], start: int = 0) -> int:
        """Index one past the last of the consecutive keys from ``start`` held in host memory."""
        i = start
        while i < len(keys) and self.host.contains(keys[i]):
            i += 1
        return i

    def prefetch(self, keys: Sequence[ChunkKey]) -> PrefetchResult:
        """Bring the longest prefix of ``keys`` that some tier holds into host memory (blocking).

        Tiers are asked in order; each continues where the previous one
        stopped. Corrupt chunks are misses (the tier quarantines them).
        """
        result = PrefetchResult()
        remaining = list(keys)
        for tier in self.tiers:
            if not remaining:
                break
            try:
                n = tier.lookup_prefix(remaining)
                if n == 0:
                    continue
                before = tier.corrupt_detected
                datas = tier.get_many(remaining[:n])
                result.corrupt += tier.corrupt_detected - before
            except (ChunkStoreError, OSError) as exc:
                log.warning("chunkstore: prefetch from %s failed: %s", tier.name, exc)
                result.error = f"{tier.name}: {exc}"
                continue
            got = 0
            for key, data in zip(remaining, datas):
                if data is None:
                    break
                if not self.host.put(key, _uncompressed(data)):
                    break
                got += 1
            result.fetched += got
            result.sources += [tier.kind] * got
            remaining = remaining[got:]
            if got < n:
                break
        return result

    @property
    def tiers_are_fast(self) -> bool:
        """Whether every tier answers lookups locally (no per-request round trip)."""
        return not any(tier.high_latency for tier in self.tiers)

    def tier_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` some tier holds (lookup only); errors are misses."""
        best = 0
        for tier in self.tiers:
            try:
                best = max(best, tier.lookup_prefix(keys))
            except (ChunkStoreError, OSError) as exc:
                log.warning("chunkstore: lookup in %s failed: %s", tier.name, exc)
        return best

    def submit_prefetch(self, keys: Sequence[ChunkKey]) -> Future[PrefetchResult]:
        """:meth:`prefetch` on the background pool."""
        return self._pool.submit(self.prefetch, list(keys))

    # --- data ----------------------------------------------------------------

    def get_host(self, key: ChunkKey) -> Any | None:
        """A copy of the chunk's bytes if host memory holds it."""
        return self.host.get(key)

    def read_host(self, key: ChunkKey) -> Any:
        """Context manager: the chunk's bytes in host memory (pinned meanwhile), or None."""
        return self.host.read(key)

    def put(self, key: ChunkKey, data: Any) -> None:
        """Keep a sealed chunk in host memory and write it behind to every tier."""
        self.host.put(key, data)
        for tier in self.tiers:
            future = self._pool.submit(self._write_behind, tier, key, data)
            with self._pending_lock:
                self._pending.add(future)
            future.add_done_callback(self._done)

    def _done(self, future: Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def _write_behind(self, tier: Store, key: ChunkKey, data: Any) -> None:
        try:
            payload = recompress(data, "zstd") if self.compression == "zstd" else data
            tier.put_if_absent(key, payload)
        except Exception as exc:  # noqa: BLE001 - a failed write is a future miss, never a crash
            self.write_errors += 1
            log.warning("chunkstore: write of %s to %s failed: %s", key.hex, tier.name, exc)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every write-behind submitted so far has finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._pending_lock:
                pending = list(self._pending)
            if not pending:
                return
            for future in pending:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                future.exception(timeout=left)

    def reset_host(self) -> None:
        """Forget everything in host memory (secondary tiers keep their chunks)."""
        self.host.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.flush(timeout=30)
        finally:
            self._pool.shutdown(wait=True)
            for tier in [*self.tiers, self.host]:
                try:
                    tier.close()
                except Exception:  # noqa: BLE001
                    log.exception("chunkstore: closing %s failed", tier)


def _host_tier(host_bytes: int, layout: ChunkLayout | None, policy: str) -> Any:
    """The core HostCache when this chunkstore has one and the layout is known; else a dict LRU."""
    if layout is not None:
        try:
            from chunkstore.cache import HostCache
        except ImportError:
            HostCache = None  # noqa: N806 - an older core without the cache package
        if HostCache is not None:
            return _HostCacheTier(
                HostCache(layout, capacity_bytes=host_bytes, policy=policy, name="host")
            )
    return _HostMemory(host_bytes)


def _uncompressed(data: Any) -> Any:
    """Host memory holds uncompressed chunks, ready to copy to the device."""
    try:
        if read_header(data).compression == "none":
            return data
        return recompress(data, "none")
    except FormatError:
        return data


_SHARED: dict[str, ConnectorStore] = {}
_SHARED_LOCK = threading.Lock()


def shared_store(name: str, factory: Any) -> ConnectorStore:
    """The process's store for ``name`` (the engine id), made by ``factory()`` on first use.

    The scheduler and worker connectors of one engine live in the same process
    whenever TP is 1 (always, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and in
    the engine-core process of ``vllm serve``); they share host memory this way.
    """
    with _SHARED_LOCK:
        store = _SHARED.get(name)
        if store is None or store.closed:
            store = factory()
            _SHARED[name] = store
        return store


def flush_shared(timeout: float | None = None) -> None:
    """Wait for the write-behind of every shared store of this process (tests, benchmarks)."""
    with _SHARED_LOCK:
        stores = list(_SHARED.values())
    for store in stores:
        store.flush(timeout=timeout)


def release_shared(name: str) -> None:
    """Close and forget the shared store ``name``."""
    with _SHARED_LOCK:
        store = _SHARED.pop(name, None)
    if store is not None:
        store.close()
