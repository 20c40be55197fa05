"""The registry of memory on huge pages: buffers the fs store reads O_DIRECT at any size."""

from __future__ import annotations

import ctypes
import gc
import mmap
import threading
from collections.abc import Iterator

import pytest

from chunkstore import _hugepages
from chunkstore._hugepages import (
    covers,
    map_huge_aligned,
    register,
    unregister,
    unregister_mapping,
)

BASE = 1 << 50
"""Addresses past any user-space mapping (x86-64 and arm64 stop at 2**47-2**48), so that the
ranges the tests register never meet real ones the process holds."""
MIB = 1 << 20
HUGE = _hugepages.huge_page_size()
needs_thp = pytest.mark.skipif(HUGE is None, reason="no transparent huge pages on this machine")


@pytest.fixture(autouse=True)
def registry_left_as_found() -> Iterator[None]:
    before = (list(_hugepages._starts), list(_hugepages._ends))
    yield
    unregister(BASE, 1 << 40)
    assert (_hugepages._starts, _hugepages._ends) == before


def test_a_buffer_is_covered_only_within_one_registered_range() -> None:
    assert not covers(BASE, MIB)
    register(BASE, 4 * MIB)
    assert covers(BASE, 4 * MIB)
    assert covers(BASE + MIB, MIB)
    assert covers(BASE + 4 * MIB - 1, 1)  # its last byte
    assert not covers(BASE, 4 * MIB + 1)  # one byte past its end
    assert not covers(BASE - 1, 2)  # one byte before its start
    assert not covers(BASE + 4 * MIB, 1)  # the end is not in it


def test_a_buffer_across_two_ranges_is_not_covered() -> None:
    register(BASE + 4 * MIB, 4 * MIB)  # registered out of order
    register(BASE, 4 * MIB)
    assert covers(BASE, 4 * MIB) and covers(BASE + 4 * MIB, 4 * MIB)
    assert not covers(BASE + 3 * MIB, 2 * MIB)  # two mappings, not one


def test_nothing_is_registered_for_no_bytes() -> None:
    register(BASE, 0)
    assert not covers(BASE, 0)
    assert _hugepages._starts.count(BASE) == 0


def test_unregister_takes_out_the_ranges_within_and_nothing_else() -> None:
    register(BASE, MIB)
    register(BASE + 2 * MIB, MIB)
    register(BASE + 8 * MIB, 4 * MIB)
    unregister(BASE, 4 * MIB)  # the first two lie within
    assert not covers(BASE, MIB) and not covers(BASE + 2 * MIB, MIB)
    unregister(BASE + 8 * MIB, 2 * MIB)  # only part of the third: it stays
    assert covers(BASE + 8 * MIB, 4 * MIB)
    unregister(BASE + 8 * MIB, 4 * MIB)
    assert not covers(BASE + 8 * MIB, MIB)
    unregister(BASE + 8 * MIB, 4 * MIB)  # nothing left there: no error


def test_unregister_mapping_takes_out_what_lies_in_the_mapping() -> None:
    mapping = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    try:
        register(address + mmap.PAGESIZE, 2 * mmap.PAGESIZE)
        assert covers(address + mmap.PAGESIZE, mmap.PAGESIZE)
        unregister_mapping(mapping)
        assert not covers(address + mmap.PAGESIZE, mmap.PAGESIZE)
    finally:
        mapping.close()


def test_threads_registering_and_unregistering_at_once_leave_it_consistent() -> None:
    wrong: list[int] = []  # (an assert in a thread would not fail the test)

    def churn(lane: int) -> None:
        for i in range(300):
            start = BASE + (lane * 1000 + i) * MIB
            register(start, MIB)
            if not covers(start, MIB):
                wrong.append(start)
            if i % 2:
                unregister(start, MIB)
                if covers(start, MIB):
                    wrong.append(start)

    threads = [threading.Thread(target=churn, args=(lane,)) for lane in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    left = [s for s in _hugepages._starts if s >= BASE]
    assert left == sorted(
        BASE + (lane * 1000 + i) * MIB for lane in range(4) for i in range(0, 300, 2)
    )
    assert all(covers(s, MIB) for s in left)


@needs_thp
def test_a_mapping_collected_unclosed_is_taken_out() -> None:
    assert HUGE is not None
    listed = list(_hugepages._starts)
    mapping, start = map_huge_aligned(4 * HUGE, 0, HUGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + start
    assert covers(address, 4 * HUGE)
    del mapping  # dropped by an owner that never unregistered it
    gc.collect()
    # Its address may now hold memory on 4 KiB pages: the registry no longer vouches for it.
    assert not covers(address, 4 * HUGE)
    assert _hugepages._starts == listed


@needs_thp
def test_a_mapping_unregistered_then_collected_leaves_later_ranges_alone() -> None:
    assert HUGE is not None
    mapping, start = map_huge_aligned(4 * HUGE, 0, HUGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + start
    unregister_mapping(mapping)
    mapping.close()
    register(address, 4 * HUGE)  # a later mapping at the same address (here: listed by hand)
    try:
        del mapping
        gc.collect()
        assert covers(address, 4 * HUGE)
    finally:
        unregister(address, 4 * HUGE)


@needs_thp
def test_a_mapping_collected_while_the_registry_is_busy_on_this_thread_does_not_block() -> None:
    assert HUGE is not None
    mapping, start = map_huge_aligned(2 * HUGE, 0, HUGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + start
    # The garbage collector may run inside a registry call (any allocation there): what it
    # does for a collected mapping must not wait for the lock that call holds.
    with _hugepages._registry_lock:
        del mapping
        gc.collect()
    assert not covers(address, 2 * HUGE)
