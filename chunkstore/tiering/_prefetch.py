"""The prefetcher: a tiered store's chain walks on background threads.

:meth:`Prefetcher.lookup_prefix_async` runs the owner's ``lookup_prefix``.
It serves a scheduler that must not wait for a slow tier.
:meth:`Prefetcher.prefetch` walks the chain the same way. It brings each
tier's run of chunks into host memory with
:meth:`~chunkstore.tiering._promotion.Promoter.pull`. Both return a future
that never fails. A tier error or a closed store only shortens the result. The
worker threads start on first use.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from chunkstore.cache._host import HostCache
from chunkstore.cache._lease import Lease
from chunkstore.hashing import ChunkKey
from chunkstore.tiering._guard import GuardedTier
from chunkstore.tiering._promotion import Promoter

log = logging.getLogger(__name__)

R = TypeVar("R")

HOST_SOURCE = "host"
"""What :meth:`Prefetcher.prefetch` reports for a chunk that was already in host memory."""


class Prefetcher:
    """Background lookups and prefetches over ``host`` and ``tiers``, in lookup order.

    ``lookup_prefix`` is the owner's synchronous walk. Once the owner has
    closed, ``check_open`` raises and ``closed`` answers True. A job then ends
    quietly with what it has. ``workers`` threads serve the jobs.
    """

    def __init__(
        self,
        host: HostCache,
        tiers: Sequence[GuardedTier],
        promoter: Promoter,
        lookup_prefix: Callable[[Sequence[ChunkKey]], int],
        *,
        check_open: Callable[[], None],
        closed: Callable[[], bool],
        name: str,
        workers: int,
    ) -> None:
        self._host = host
        self._tiers = tuple(tiers)
        self._promoter = promoter
        self._lookup_prefix = lookup_prefix
        self._check_open = check_open
        self._closed = closed
        self._name = name
        self._workers = workers
        self._lock = threading.Lock()
        self._background: ThreadPoolExecutor | None = None

    def lookup_prefix_async(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """Run the owner's ``lookup_prefix`` on a background thread; 0 at worst."""
        return self._submit(self._lookup_quietly, list(keys), default=0)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[list[str]]:
        """Bring the leading present ``keys`` into host memory; report each one's source.

        See :meth:`chunkstore.tiering.TieredStore.prefetch` for the contract.
        """
        return self._submit(self._prefetch_quietly, list(keys), default=[])

    def close(self) -> None:
        """Wait for the running jobs once the owner has closed.

        Each job sees the close at its next step.
        """
        with self._lock:
            background, self._background = self._background, None
        if background is not None:
            background.shutdown(wait=True)

    def _submit(
        self, fn: Callable[[list[ChunkKey]], R], keys: list[ChunkKey], *, default: R
    ) -> Future[R]:
        with self._lock:
            if not self._closed() and self._background is None:
                self._background = ThreadPoolExecutor(
                    max_workers=self._workers,
                    thread_name_prefix=f"chunkstore-prefetch-{self._name}",
                )
            background = self._background
        if background is not None:
            try:
                return background.submit(fn, keys)
            except RuntimeError:  # shut down by a concurrent close()
                pass
        done: Future[R] = Future()
        done.set_result(default)
        return done

    def _lookup_quietly(self, keys: list[ChunkKey]) -> int:
        try:
            return self._lookup_prefix(keys)
        except Exception as exc:  # noqa: BLE001 - a background lookup reports a miss instead
            log.warning("%s: background lookup stopped: %s", self._name, exc)
            return 0

    def _prefetch_quietly(self, keys: list[ChunkKey]) -> list[str]:
        sources: list[str] = []
        try:
            self._prefetch_into(keys, sources)
        except Exception as exc:  # noqa: BLE001 - a prefetch ends short instead of failing
            if not self._closed():
                log.warning(
                    "%s: prefetch stopped after %d chunks: %s", self._name, len(sources), exc
                )
        return sources

    def _prefetch_into(self, keys: list[ChunkKey], sources: list[str]) -> None:
        """Walk the chain like ``lookup_prefix``, loading each tier's run into host memory.

        Every chunk of the prefix stays pinned until the walk ends. So loading a
        later chunk can never evict an earlier one. When host memory cannot hold
        more, the prefix ends there.
        """
        held: list[Lease] = []
        try:
            position = 0
            while position < len(keys):
                self._check_open()
                while position < len(keys):
                    lease = self._host.acquire(keys[position])
                    if lease is None:
                        break
                    held.append(lease)
                    sources.append(HOST_SOURCE)
                    position += 1
                if position == len(keys):
                    return
                progress = False
                for tier in self._tiers:
                    if not tier.up:
                        continue
                    found = tier.lookup_prefix(keys[position:])
                    if not found:
                        continue
                    loaded = self._promoter.pull(tier, keys[position : position + found], held)
                    if loaded:
                        sources.extend([tier.store.kind] * loaded)
                        position += loaded
                        progress = True
                        break
                if not progress:
                    return
        finally:
            for lease in held:
                self._host.release(lease)
