"""IoPool: order, bounded threads, failures after the whole batch, nesting, close."""

from __future__ import annotations

import threading
import time

import pytest

from chunkstore.backends._iopool import IoPool, raise_first
from chunkstore.errors import ConfigError


def test_results_keep_input_order_with_at_most_workers_threads() -> None:
    pool = IoPool(3, "t")
    running = 0
    most = 0
    lock = threading.Lock()

    def work(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.001 * (i % 3))  # finish out of order
        with lock:
            running -= 1
        return i * i

    assert pool.map(work, list(range(20))) == [i * i for i in range(20)]
    assert 1 <= most <= 3
    pool.close()


def test_a_failure_is_raised_after_every_item_ended() -> None:
    pool = IoPool(4, "t")
    done: list[int] = []

    def work(i: int) -> int:
        if i in (2, 5):
            raise ValueError(f"item {i}")
        time.sleep(0.002)
        done.append(i)
        return i

    with pytest.raises(ValueError, match="item 2"):  # the first failure in input order
        pool.map(work, list(range(8)))
    assert sorted(done) == [0, 1, 3, 4, 6, 7]
    pool.close()


def test_nested_batches_run_inline_instead_of_deadlocking() -> None:
    pool = IoPool(2, "t")

    def outer(i: int) -> list[int]:
        return pool.map(lambda j: i * 10 + j, [0, 1, 2])

    assert pool.map(outer, [1, 2, 3, 4]) == [[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]]
    pool.close()


def test_the_callers_thread_works_beside_the_pools() -> None:
    pool = IoPool(2, "t")
    together = threading.Barrier(2, timeout=10)

    def work(i: int) -> str:
        together.wait()  # both items run at once: on two threads
        return threading.current_thread().name

    names = pool.map(work, [0, 1])
    assert sorted(n.startswith("chunkstore-io-t") for n in names) == [False, True]
    assert threading.current_thread().name in names
    pool.close()


def test_a_failure_in_one_thread_leaves_the_others_taking_items() -> None:
    pool = IoPool(3, "t")
    seen: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            seen.append(i)
        if i % 4 == 0:
            raise OSError(f"item {i}")
        return i

    with pytest.raises(OSError, match="item 0"):
        pool.map(work, list(range(17)))
    assert sorted(seen) == list(range(17))  # every item ran, each once
    pool.close()


def test_a_batch_does_not_wait_for_its_helpers_queued_behind_another_batch() -> None:
    pool = IoPool(2, "t")  # one pool thread
    release = threading.Event()
    started = threading.Event()

    def slow(i: int) -> int:
        if threading.current_thread().name.startswith("chunkstore-io-t"):
            started.set()
            release.wait(10)
        else:
            started.wait(10)  # the caller's item waits until the pool thread holds the other
        return i

    first: list[list[int]] = []
    other = threading.Thread(target=lambda: first.append(pool.map(slow, [0, 1])))
    other.start()
    assert started.wait(10)  # the pool's only thread is busy with the first batch
    # this batch's helper is queued behind it; the caller does both items and returns
    assert pool.map(lambda i: i * 2, [1, 2, 3]) == [2, 4, 6]
    assert other.is_alive()  # returned while the first batch still holds the pool's thread
    release.set()
    other.join(10)
    assert first == [[0, 1]]
    pool.close()


def test_close_stops_threads_and_later_batches_run_inline() -> None:
    pool = IoPool(2, "t")
    together = threading.Barrier(2, timeout=10)

    def work(i: int) -> str:
        together.wait()
        return threading.current_thread().name

    assert any(n.startswith("chunkstore-io-t") for n in pool.map(work, [0, 1]))
    assert pool.started
    pool.close()
    assert not pool.started
    assert (
        pool.map(lambda i: threading.current_thread().name, [0, 1])
        == [threading.current_thread().name] * 2
    )


def test_workers_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="io_workers"):
        IoPool(0, "t")


def test_an_interrupt_is_raised_before_an_earlier_ordinary_error() -> None:
    pool = IoPool(2, "interrupt")

    def fail(i: int) -> int:
        if i == 0:
            raise ValueError("first in input order")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pool.map(fail, [0, 1])
    with pytest.raises(ValueError):
        raise_first([None, ValueError("a"), RuntimeError("b")])
    raise_first([None, None])  # nothing to raise
    pool.close()
