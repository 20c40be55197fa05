"""Thread pools started whole: every worker running before the first task arrives."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["started_executor"]


def started_executor(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads, all of them running on return.

    The executor otherwise starts one thread per submitted task until it has
    ``workers``, so the first tasks of a burst each wait for a thread start, and
    every new thread competes for the GIL with the submitter while it does.
    Parking one task per thread on a barrier makes it
    start them all now: no thread ends its task before all have begun, so every
    submit finds no idle thread and starts one.
    """
    executor = ThreadPoolExecutor(workers, thread_name_prefix=prefix)
    barrier = threading.Barrier(workers + 1)
    try:
        for _ in range(workers):
            executor.submit(barrier.wait)
    except BaseException:
        barrier.abort()  # the threads already parked return (BrokenBarrierError) and end
        executor.shutdown(wait=True)
        raise
    barrier.wait()
    return executor
