"""A bounded write-behind queue drained by one background thread.

The caller's ``put`` only appends. When the queue is full, ``put`` says so
and the caller drops the item. It never blocks on a slow tier. Memory never
grows without bound. Items are whatever the owner wants written. Here they are
pinned host-cache leases. So a queued chunk cannot be evicted before it is
persisted. :meth:`WriteBehindQueue.withdraw` takes items back without waiting
for the queue, as for a deleted key. An item already being written goes to
``undo`` once its write has ended.
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

    ``write`` receives up to ``batch_size`` items in queue order. It owns them
    from then on. It must release whatever they hold, even when it raises.
    ``undo`` receives the batch's items that were withdrawn during the write.
    It runs on the drain thread, after ``write`` returned.
    """

    def __init__(
        self,
        write: Callable[[list[T]], None],
        *,
        capacity: int = 256,
        batch_size: int = 16,
        name: str = "chunkstore-writeback",
        undo: Callable[[list[T]], None] | None = None,
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
        self._undo = undo
        self._items: deque[T] = deque()
        self._batch: list[T] = []
        self._withdrawn_late: list[T] = []
        # Withdrawn items of the last batch while undo runs for them. A newer write around
        # the queue waits for these too. Otherwise the late undo would remove it.
        self._undoing: list[T] = []
        self._in_flight = 0
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self._thread.start()

    def offer(self, item: T) -> bool:
        """Queue ``item``; return False, without taking it, when full or closed."""
        with self._cond:
            if self._closing or len(self._items) >= self.capacity:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    @property
    def depth(self) -> int:
        """Items waiting, not counting the batch being written."""
        return len(self._items)

    @property
    def pending(self) -> int:
        """Items waiting or being written."""
        with self._cond:
            return len(self._items) + self._in_flight

    def withdraw(self, match: Callable[[T], bool]) -> list[T]:
        """Take back the waiting items for which ``match`` is true.

        The caller owns the returned items again. Matching items of the batch
        being written cannot be taken back. They go to ``undo`` when that
        write ends. This never waits for a write.
        """
        with self._cond:
            taken = [item for item in self._items if match(item)]
            if taken:
                self._items = deque(item for item in self._items if not match(item))
            self._withdrawn_late.extend(item for item in self._batch if match(item))
            self._cond.notify_all()
        return taken

    def undo_pending(self, match: Callable[[T], bool]) -> bool:
        """Whether an item ``match`` selects was withdrawn during its write, and awaits undo.

        Until its undo ends, its copy may stay in the targets.
        """
        with self._cond:
            return any(match(item) for item in (*self._withdrawn_late, *self._undoing))

    def supersede(self, match: Callable[[T], bool], timeout: float | None = None) -> list[T]:
        """Take back the waiting items ``match`` selects, then wait for the rest.

        The wait lasts up to ``timeout``, until no batch being written or undone
        holds a match. The caller owns the returned items again. This serves a
        newer write that goes around the queue. Older items must not land after
        it. So waiting ones are withdrawn, and one being written is waited for.
        They may not be undone after it either. Unlike :meth:`withdraw`, this
        sends nothing to ``undo``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            taken = [item for item in self._items if match(item)]
            if taken:
                self._items = deque(item for item in self._items if not match(item))
                self._cond.notify_all()
            while any(match(item) for item in (*self._batch, *self._undoing)):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
        return taken

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
        """Write what is queued and stop the thread; return items left unwritten on timeout."""
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
                self._batch = batch
                self._in_flight = len(batch)
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 - the drain thread must survive any tier bug
                log.exception("write-behind batch of %d items failed", len(batch))
            finally:
                with self._cond:
                    late, self._withdrawn_late = self._withdrawn_late, []
                    self._undoing = late
                    self._batch = []
                try:
                    if late and self._undo is not None:
                        self._undo(late)
                except Exception:  # noqa: BLE001 - as above
                    log.exception("undoing %d withdrawn writes failed", len(late))
                finally:
                    with self._cond:
                        self._undoing = []
                        self._in_flight = 0
                        self._cond.notify_all()
