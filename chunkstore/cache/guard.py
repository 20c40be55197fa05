"""Calls into a secondary tier with a timeout and a back-off after failures.

A tier that raises or does not answer within ``timeout`` is marked down for
``retry_after`` seconds: calls during that time fail fast (the tiered store
treats them as misses or dropped writes), and the first call after it tries
the tier again. The serving path never sees the tier's exception.

A call that times out cannot be stopped: it goes on running on its worker
thread and may still read or write the memory it was given. The
:class:`TierUnavailable` it raises therefore carries the still-running call
(``pending``), and the caller gives that memory back only from
:meth:`TierUnavailable.when_settled` (a host slot stays pinned until then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from chunkstore.backends.base import Store
from chunkstore.metrics import TierInstruments

log = logging.getLogger(__name__)

R = TypeVar("R")


class TierUnavailable(Exception):
    """Internal: the tier is in back-off, failed, or timed out (never leaves the cache package)."""

    def __init__(self, name: str, pending: Future[Any] | None = None) -> None:
        super().__init__(name)
        self.pending = pending
        """The timed-out call, still running: buffers passed to it are still in use."""

    def when_settled(self, release: Callable[[], None]) -> None:
        """Run ``release`` once nothing uses the memory handed to the failed call.

        At once when the call has ended (or never started); otherwise on the
        worker thread when the abandoned call finishes.
        """
        if self.pending is None:
            release()
        else:
            self.pending.add_done_callback(lambda _done: release())


class GuardedTier:
    """One secondary store plus its health, counters and metric instruments."""

    def __init__(
        self,
        store: Store,
        instruments: TierInstruments,
        *,
        timeout: float | None,
        retry_after: float,
        clock: Callable[[], float] = time.monotonic,
        workers: int = 4,
    ) -> None:
        self.store = store
        self.name = store.name
        self.instruments = instruments
        self.timeout = timeout
        self.retry_after = retry_after
        self._clock = clock
        self._down_until: float | None = None
        self._lock = threading.Lock()
        # Note: a call that times out keeps running on its worker (Python threads cannot be
        # stopped); the pool lets later calls proceed past a few stuck ones once the tier is
        # retried, and TierUnavailable.pending tells the caller its buffers are still in use.
        self._executor = (
            ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=f"chunkstore-tier-{self.name}"
            )
            if timeout is not None
            else None
        )
        self.hits = 0
        self.misses = 0
        self.promotions = 0
        self.writes = 0
        self.errors = 0
        self.abandoned = 0
        """Timed-out calls still running (each may hold host memory until it ends)."""
        self.dropped: dict[str, int] = {}

    @property
    def up(self) -> bool:
        """False while the tier is in back-off."""
        until = self._down_until
        return until is None or self._clock() >= until

    def call(self, op: str, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` under the timeout; raises :class:`TierUnavailable` instead of failing."""
        if not self.up:
            raise TierUnavailable(self.name)
        future: Future[R] | None = None
        try:
            if self._executor is None:
                result = fn(*args)
            else:
                future = self._executor.submit(fn, *args)
                result = future.result(self.timeout)
        except FutureTimeout:
            assert future is not None
            # A call still queued behind stuck ones is cancelled; one already running is not
            # stoppable, so the caller must keep its buffers alive until it ends.
            pending = None if future.cancel() else self._abandon(future)
            self._failed(op, f"timed out after {self.timeout} s")
            raise TierUnavailable(self.name, pending) from None
        except Exception as exc:  # noqa: BLE001 - any tier failure degrades to a miss
            self._failed(op, f"{type(exc).__name__}: {exc}")
            raise TierUnavailable(self.name) from exc
        if self._down_until is not None:
            with self._lock:
                if self._down_until is not None:
                    log.info("tier %s answers again", self.name)
                    self._down_until = None
        return result

    def _abandon(self, future: Future[R]) -> Future[R]:
        with self._lock:
            self.abandoned += 1
        future.add_done_callback(self._settled)
        return future

    def _settled(self, _future: Future[Any]) -> None:
        with self._lock:
            self.abandoned -= 1

    def count_drop(self, reason: str, count: int = 1) -> None:
        """Account ``count`` writes to this tier that were not performed."""
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        self.instruments.dropped(reason, count)

    def _failed(self, op: str, why: str) -> None:
        with self._lock:
            self.errors += 1
            first = self._down_until is None or self._clock() >= self._down_until
            self._down_until = self._clock() + self.retry_after
        self.instruments.error(op)
        if first:
            log.warning(
                "tier %s: %s %s; treating it as a miss for %.1f s",
                self.name,
                op,
                why,
                self.retry_after,
            )

    def close(self) -> None:
        """Stop the worker threads (calls still running are abandoned, not awaited)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
