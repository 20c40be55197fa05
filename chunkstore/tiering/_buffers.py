"""Reusable page-aligned chunk buffers for an engine tier's store and load jobs.

A fresh ``bytearray`` per chunk costs a zero fill on every job. It also costs
a page fault per page on first touch. These buffers are mapped once and
reused. A new one is mapped private and populated in the same call. The kernel
then fills its pages in one pass, not one fault each. The buffers are
page-aligned. So the filesystem store can read them with ``O_DIRECT`` when it
reads around the page cache. A buffer goes back to the free list only once
nothing uses it. A store call that timed out still runs. It may still read or
write its buffers. :meth:`ChunkBuffers.release_after` releases those buffers
when the abandoned call ends.

The kernel may offer transparent huge pages, in ``madvise`` or ``always``
mode. Then a buffer of at least one huge page is placed so that a chosen
offset starts a huge page. That offset is the chunk's payload. The buffer asks
for huge pages under the payload. It asks that the rest of the mapping never
be one. That costs address space, not memory. The payload is then one
physically contiguous piece per huge page. An ``O_DIRECT`` transfer of a chunk
thus reaches the device as one request of a few segments. Without huge pages,
it is many scattered pages over several requests.
``tools/bench_direct_io.py`` compares the two. vLLM's own fs tier
transfers straight from its primary region, in shared-memory pages. A tier
that must copy to convert the layout gets huge pages at no extra cost.
"""

from __future__ import annotations

import errno
import mmap
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future

from chunkstore._hugepages import PAGE, huge_page_size, map_huge_aligned, unregister_mapping

__all__ = ["PAGE", "ChunkBuffers", "huge_page_size"]

_NEW_BUFFER_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
"""Mapping flags: private, with no shared-memory file behind it, populated at once."""
# Linux >= 5.14 has it; Python 3.11 has no name for it.
_MADV_POPULATE_WRITE = 23
"""``madvise`` advice that faults a range in, writable, in one call."""


class ChunkBuffers:
    """A free list of page-aligned buffers of ``size`` bytes, with at most ``keep`` idle."""

    def __init__(self, size: int, keep: int, huge_at: int = 0) -> None:
        self.size = -(-size // PAGE) * PAGE
        """Bytes per buffer, a whole number of pages."""
        self._keep = keep
        self._huge_at = huge_at
        """Offset in each buffer that starts a huge page, where huge pages are used."""
        huge = huge_page_size()
        self._huge = huge if huge is not None and self.size - huge_at >= huge else None
        self._free: list[memoryview] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def huge_pages(self) -> bool:
        """Whether new buffers ask for huge pages from ``huge_at`` on."""
        # What the kernel gave shows in /proc/meminfo's AnonHugePages.
        return self._huge is not None

    def take(self, count: int) -> list[memoryview]:
        """``count`` buffers, reused where idle ones exist."""
        with self._lock:
            reused = self._free[len(self._free) - min(count, len(self._free)) :]
            del self._free[len(self._free) - len(reused) :]
        return reused + self._map(count - len(reused))

    def reserve(self, count: int) -> None:
        """Map idle buffers now, up to ``count`` and ``keep`` of them.

        The first jobs then map none. Threads that all map their first buffers
        at once would delay the first chunk.
        """
        with self._lock:
            wanted = min(count, self._keep) - len(self._free)
        if wanted > 0:
            self.give(self._map(wanted))

    def _map(self, count: int) -> list[memoryview]:
        return [self._map_one() for _ in range(count)]

    def _map_one(self) -> memoryview:
        huge = self._huge
        if huge is None:
            return memoryview(mmap.mmap(-1, self.size, flags=_NEW_BUFFER_FLAGS))
        # Populate only after map_huge_aligned asked for the huge pages. A small page faulted
        # in first would keep its huge page from forming.
        mapping, start = map_huge_aligned(self.size, self._huge_at, huge)
        try:
            _populate(mapping, start, self.size)
        except BaseException:
            _unmap(memoryview(mapping))
            raise
        return memoryview(mapping)[start : start + self.size]

    def give(self, buffers: Iterable[memoryview]) -> None:
        """Return buffers that nothing uses any more; idle ones past ``keep`` are unmapped."""
        with self._lock:
            for buffer in buffers:
                # After close, buffers kept by calls abandoned at shutdown are unmapped.
                if not self._closed and len(self._free) < self._keep:
                    self._free.append(buffer)
                else:
                    _unmap(buffer)

    def release_after(self, pending: Sequence[Future[object]], buffers: list[memoryview]) -> None:
        """Give ``buffers`` back once every call in ``pending`` has ended, or now if none."""
        waiting = [f for f in pending if not f.done()]
        if not waiting:
            self.give(buffers)
            return
        left = [len(waiting)]
        lock = threading.Lock()

        def settled(_future: Future[object]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.give(buffers)

        for future in waiting:
            future.add_done_callback(settled)

    def close(self) -> None:
        """Unmap the idle buffers."""
        with self._lock:
            free, self._free = self._free, []
            self._closed = True
        for buffer in free:
            _unmap(buffer)


def _populate(mapping: mmap.mmap, start: int, length: int) -> None:
    """Fault ``length`` bytes from ``start`` in now, writable.

    The first chunk converted into a new buffer then pays no page faults on the
    job's thread.
    """
    try:
        mapping.madvise(_MADV_POPULATE_WRITE, start, length)
        return
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14; touch each page
            raise
    view = memoryview(mapping)
    try:
        for offset in range(start, start + length, PAGE):
            view[offset] = 0
    finally:
        view.release()


def _unmap(buffer: memoryview) -> None:
    """Release a buffer's view and unmap the mapping under it."""
    mapping = buffer.obj
    assert isinstance(mapping, mmap.mmap)  # every buffer here is a view of its own mapping
    # Before the unmap: the registry must not vouch for whatever is mapped here next.
    unregister_mapping(mapping)
    buffer.release()
    try:
        mapping.close()
    except BufferError:  # a view of it is still alive somewhere: the GC unmaps it later
        pass
