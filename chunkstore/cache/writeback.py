"""A bounded write-behind queue drained by one background thread.

The caller's ``put`` only appends (or, when the queue is full, is told so and
drops): it never blocks on a slow tier and memory never grows without bound.
Items are whatever the owner wants written; here, pinned host-cache leases,
so a queued chunk cannot be evicted before it is persisted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from chunkstore.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")


class WriteBehindQueue(Generic[T]):
    """At most ``capacity`` items waiting; ``write(batch)`` runs on the drain thread.

    ``write`` receives up to ``batch_size`` items in queue order and owns them
    from then on (it must release whatever they hold, even when it raises).
    """

    def __init__(
        self,
        write: Callable[[list[T]], None],
        *,
        capacity: int = 256,
        batch_size: int = 16,
        name: str = "chunkstore-writeback",
    ) -> None:
        if capacity < 1 or batch_size < 1:
            raise ConfigError(
                "write-behind queue needs capacity >= 1 and batch >= 1 "
                f"(got {capacity}, {batch_size})"
            )
        self.capacity = capacity
        """Most items that may wait."""
        self.batch_size = batch_size
        """Most items handed to one ``write`` call."""
        self._write = write
        self._items: deque[T] = deque()
        self._in_flight = 0
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self._thread.start()

    def offer(self, item: T) -> bool:
        """Queue ``item``; False (and the item is not taken) when full or closed."""
        with self._cond:
            if self._closing or len(self._items) >= self.capacity:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    @property
    def depth(self) -> int:
        """Items waiting (not counting the batch being written)."""
        return len(self._items)

    @property
    def pending(self) -> int:
        """Items waiting or being written."""
        with self._cond:
            return len(self._items) + self._in_flight

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._items or self._in_flight:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float | None = None) -> list[T]:
        """Write what is queued, stop the thread; returns items left unwritten on timeout."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            leftovers = list(self._items)
            self._items.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        return leftovers

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closing:
                    self._cond.wait()
                if not self._items:
                    return
                count = min(self.batch_size, len(self._items))
                batch = [self._items.popleft() for _ in range(count)]
                self._in_flight = len(batch)
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 - the drain thread must survive any tier bug
                log.exception("write-behind batch of %d items failed", len(batch))
            finally:
                with self._cond:
                    self._in_flight = 0
                    self._cond.notify_all()
