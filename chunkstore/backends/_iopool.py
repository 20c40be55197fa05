"""A small, bounded pool of I/O threads that a store owns, for batched calls.

Batched reads and writes of whole chunks spend most of their time in system
calls (``preadv``, ``write``, ``rename``) that release the GIL, so a few
threads keep several chunk I/Os in flight: while one thread hashes the block
it just read, the others wait on the disk or copy from the page cache. The
pool is started on first use, never holds more than ``workers`` threads, and
is shut down by the store's ``close``.

Results keep the order of the inputs. A batch always runs to its end before
the call returns (no thread keeps touching a caller's buffer afterwards);
then the first exception, in input order, is raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from chunkstore.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")


class IoPool:
    """Up to ``workers`` threads running one store's batched chunk I/O.

    ``workers=1`` runs everything on the caller's thread (no pool at all).
    Single-item batches always run inline: a hand-off costs more than it saves,
    and so do batches started on one of the pool's own threads (a nested batch
    waiting for free workers that are all waiting for it would never end).
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
        futures: list[Future[R]] = []
        try:
            for item in items:
                futures.append(executor.submit(fn, item))
        except RuntimeError:  # shut down by a concurrent close(): finish inline
            done = len(futures)
            wait(futures)
            return [f.result() for f in futures] + [fn(item) for item in items[done:]]
        wait(futures)
        return [f.result() for f in futures]

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
                    max_workers=self.workers, thread_name_prefix=self._prefix
                )
            return self._executor

    @property
    def started(self) -> bool:
        """Whether threads exist (the pool starts on the first batch of two or more)."""
        return self._executor is not None

    def close(self) -> None:
        """Wait for running batches and stop the threads; later batches run inline."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
