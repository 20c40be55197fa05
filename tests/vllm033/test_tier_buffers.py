"""ChunkBuffers: reused page-aligned buffers, held back while an abandoned call may use them."""

from __future__ import annotations

import ctypes
from concurrent.futures import Future

from chunkstore.vllm.native.buffers import PAGE, ChunkBuffers


def _address(buffer) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def test_buffers_are_page_aligned_whole_pages_and_reused():
    pool = ChunkBuffers(PAGE + 1, keep=2)
    assert pool.size == 2 * PAGE
    first = pool.take(3)
    assert all(len(b) == 2 * PAGE and _address(b) % PAGE == 0 for b in first)
    pool.give(first)  # only two are kept idle
    again = pool.take(3)
    assert sum(any(a is b for b in first) for a in again) == 2
    pool.close()


def test_buffers_of_an_abandoned_call_come_back_only_when_it_ends():
    pool = ChunkBuffers(PAGE, keep=4)
    held = pool.take(2)
    running, finished = Future(), Future()
    finished.set_result(None)
    pool.release_after([running, finished], held)
    fresh = pool.take(2)
    assert not any(a is b for a in fresh for b in held)  # still in use by the running call
    running.set_result(None)
    back = pool.take(2)
    assert all(any(a is b for b in held) for a in back)
    pool.close()
