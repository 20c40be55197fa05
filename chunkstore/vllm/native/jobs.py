"""One store job's chunks, written in parallel, ending as one vLLM ``JobResult``.

vLLM hands a secondary tier jobs of several chunks. Run as one task each, a
job's chunks go one after another on one thread: its disk stands idle while
that thread converts and checksums the next chunk, and only as many writes are
in flight as jobs are. The tier instead runs each chunk as its own task on
its threads, so one job's chunks convert and write side by side (one thread
converts while another's write is on the disk), and tracks here when the last
one ends: then, and only then, the job's result is published and its future
(what ``drain_jobs`` and ``shutdown`` wait for) completes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from vllm.v1.kv_offload.tiering.base import JobResult

__all__ = ["StoreProgress"]


class StoreProgress:
    """Counts one store job's chunks down to its :class:`JobResult`.

    ``chunks`` tasks each report once through :meth:`chunk_done`; ``complete``
    is False when some of the job's keys were skipped before any task ran (no
    tokens for them), which fails the job whatever its chunks do. A job of no
    chunks ends at once.
    """

    def __init__(
        self,
        job_id: int,
        chunks: int,
        *,
        complete: bool,
        publish: Callable[[JobResult], None],
    ) -> None:
        self.job_id = job_id
        self.future: Future[None] = Future()
        """Done once the job's result is published."""
        self._left = chunks
        self._ok = complete
        self._nbytes = 0
        self._started: float | None = None
        self._publish = publish
        self._lock = threading.Lock()
        if chunks == 0:
            self._end()

    def chunk_started(self) -> None:
        """A task begins one of the job's chunks (the job's transfer time starts at the first)."""
        with self._lock:
            if self._started is None:
                self._started = time.perf_counter()

    def chunk_done(self, stored: bool, nbytes: int) -> None:
        """One chunk ended: written to every store (``stored``) or not; ``nbytes`` written."""
        with self._lock:
            self._left -= 1
            self._ok = self._ok and stored
            self._nbytes += nbytes
            last = self._left == 0
        if last:
            self._end()

    def _end(self) -> None:
        started = self._started
        elapsed = 0.0 if started is None else time.perf_counter() - started
        # Published before the future completes: whoever waited on it finds the result.
        self._publish(JobResult(self.job_id, self._ok, None, elapsed, self._nbytes))
        self.future.set_result(None)
