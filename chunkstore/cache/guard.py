"""Calls into a secondary tier with a timeout and a back-off after failures.

A tier that raises or does not answer within ``timeout`` is marked down for
``retry_after`` seconds: calls during that time fail fast (the tiered store
treats them as misses or dropped writes), and the first call after it tries
the tier again. The serving path never sees the tier's exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from chunkstore.backends.base import Store
from chunkstore.metrics import TierInstruments

log = logging.getLogger(__name__)

R = TypeVar("R")


class TierUnavailable(Exception):
    """Internal: the tier is in back-off, failed, or timed out (never leaves the cache package)."""


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
        # Note: a call that times out keeps running on its worker; the pool lets later
        # calls proceed past a few stuck ones once the tier is retried.
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
        try:
            if self._executor is None:
                result = fn(*args)
            else:
                result = self._executor.submit(fn, *args).result(self.timeout)
        except FutureTimeout:
            self._failed(op, f"timed out after {self.timeout} s")
            raise TierUnavailable(self.name) from None
        except Exception as exc:  # noqa: BLE001 - any tier failure degrades to a miss
            self._failed(op, f"{type(exc).__name__}: {exc}")
            raise TierUnavailable(self.name) from exc
        if self._down_until is not None:
            with self._lock:
                if self._down_until is not None:
                    log.info("tier %s answers again", self.name)
                    self._down_until = None
        return result

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
            log.warning("tier %s: %s %s; treating it as a miss for %.1f s",
                        self.name, op, why, self.retry_after)

    def close(self) -> None:
        """Stop the worker threads (calls still running are abandoned, not awaited)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
