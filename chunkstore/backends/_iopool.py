"""A small, bounded pool of I/O threads that a store owns, for batched calls.

Batched reads and writes of whole chunks spend most of their time in system calls.
Those are ``preadv``, ``write`` and ``rename``, and they release the GIL.
So a few threads keep several chunk I/Os in flight.
While one thread hashes the block it just read, the others wait on the disk or copy.
The pool is started on first use, and shut down by the store's ``close``.
It never holds more than ``workers - 1`` threads.
The caller's thread is the ``workers``-th: it works through the batch too.

Each thread takes the next item of the batch until none is left.
A batch thus costs one hand-off per thread, not one per chunk.
Per chunk, a future, a queue hand-off and a wake-up would cost more Python under the GIL.
They cost more than the chunk's own bookkeeping.

Results keep the order of the inputs.
A batch always runs to its end before the call returns.
So no thread keeps touching a caller's buffer afterwards, even when the caller is interrupted.
An interrupt stops handing out items, and is raised once the helpers' items have ended.
Then the first exception in input order is raised.
An interrupt, KeyboardInterrupt, is raised before any other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from chunkstore.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")
_NOT_RUN = object()


class IoPool:
    """Up to ``workers`` threads running one store's batched chunk I/O.

    ``workers=1`` runs everything on the caller's thread, with no pool at all.
    Single-item batches always run inline, since a hand-off costs more than it saves.
    So do batches started on one of the pool's own threads.
    A nested batch waiting for free workers that all wait for it would never end.
    A batch from any other thread runs on that thread and up to ``workers - 1`` of the pool's.
    """

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ConfigError(f"io_workers must be at least 1, got {workers}")
        self.workers = int(workers)
        self._prefix = f"chunkstore-io-{name}"
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[fn(item) for item in items]``, up to ``workers`` at a time, in input order."""
        executor = self._executor_for(len(items))
        if executor is None:
            return [fn(item) for item in items]
        results: list[Any] = [_NOT_RUN] * len(items)
        errors: list[BaseException | None] = [None] * len(items)
        indices = iter(range(len(items)))
        lock = threading.Lock()
        stopped = [False]

        def drain() -> None:
            while True:
                with lock:
                    i = -1 if stopped[0] else next(indices, -1)
                if i < 0:
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as exc:  # noqa: BLE001 - re-raised in input order below
                    errors[i] = exc
                    if not isinstance(exc, Exception):
                        stopped[0] = True  # interrupted: start no more items

        helpers: list[Future[None]] = []
        try:
            for _ in range(min(self.workers, len(items)) - 1):
                helpers.append(executor.submit(drain))
        except RuntimeError:  # shut down by a concurrent close(): this thread does the rest
            pass
        try:
            drain()
        finally:
            # Every item is taken (or, when this thread was interrupted, none is handed out
            # any more): a helper still queued (behind other batches) has nothing left to do,
            # so it is dropped, not waited for (wait() counts a cancelled future as done only
            # once a worker dequeues it); helpers that started are waited for even then, so
            # no thread touches a caller's buffer after the call.
            stopped[0] = True
            _wait_for_all([helper for helper in helpers if not helper.cancel()])
        raise_first(errors)
        return results

    def _executor_for(self, count: int) -> ThreadPoolExecutor | None:
        if count < 2 or self.workers == 1:
            return None
        if threading.current_thread().name.startswith(self._prefix):
            return None
        with self._lock:
            if self._closed:
                return None
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.workers - 1, thread_name_prefix=self._prefix
                )
            return self._executor

    @property
    def started(self) -> bool:
        """Whether the pool exists (it starts on the first batch of two or more)."""
        return self._executor is not None

    def close(self) -> None:
        """Wait for running batches and stop the threads; later batches run inline."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _wait_for_all(futures: list[Future[None]]) -> None:
    """Wait until every future is done, even through an interrupt, raised afterwards.
    A helper still running reads into or writes from the caller's buffers."""
    interrupted: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # noqa: BLE001 - raised once every helper has ended
            interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted


def raise_first(errors: Sequence[BaseException | None]) -> None:
    """Raise the first error of a batch, in input order.
    An interrupt comes before any ordinary error.
    An interrupt is any BaseException that is not an Exception, such as KeyboardInterrupt."""
    first: BaseException | None = None
    for error in errors:
        if error is None:
            continue
        if not isinstance(error, Exception):
            raise error
        if first is None:
            first = error
    if first is not None:
        raise first
