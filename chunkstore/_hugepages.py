"""Transparent huge pages for memory that the filesystem store reads and writes with ``O_DIRECT``.

An ``O_DIRECT`` transfer of a 2 MiB chunk from memory in scattered 4 KiB pages
reaches the block device as 513 physical segments; a virtio disk that takes at
most 254 segments a request (``/sys/block/*/queue/max_segments``) then splits
every chunk into three requests. From memory backed by huge pages the same
chunk is one or two physically contiguous pieces, one request. Both the
native vLLM tier's chunk buffers (:mod:`chunkstore.tiering._buffers`) and
the host cache's private slot pool (:mod:`chunkstore.cache._pool`) map their
memory here.

The kernel gives huge pages only to *private* anonymous memory in THP
``madvise`` mode, and only where the range was ``madvise(MADV_HUGEPAGE)``-d
before its first touch: a 4 KiB page faulted in first keeps its huge page from
forming. Shared anonymous memory and ``/dev/shm`` files are shmem, which gets
huge pages only under ``shmem_enabled`` (often ``never``).

Memory mapped here whose huge pages were asked for is listed in a process-wide
registry (:func:`covers`) until its owner unmaps it (:func:`unregister`), or,
where an owner drops it unclosed, until the garbage collector takes it: the
filesystem store reads a large cold chunk around the page cache only into
such memory, where one request per huge page beats readahead (see
:data:`chunkstore.backends._fastread.READAHEAD_FROM`).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import mmap
import threading
import weakref
from functools import cache
from pathlib import Path

__all__ = [
    "advise_huge_pages",
    "covers",
    "huge_page_size",
    "map_huge_aligned",
    "register",
    "unregister",
    "unregister_mapping",
]

PAGE = mmap.PAGESIZE
PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
"""Flags of the mappings made here: private anonymous memory (no shared-memory file behind it,
the kind THP ``madvise`` mode serves)."""
_THP = Path("/sys/kernel/mm/transparent_hugepage")


@cache
def huge_page_size() -> int | None:
    """The transparent huge page size where the kernel gives huge pages to ``madvise``-d
    anonymous memory; None elsewhere (other systems, THP ``never``)."""
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return None
    try:
        enabled = (_THP / "enabled").read_text()
        size = int((_THP / "hpage_pmd_size").read_text())
        # Linux >= 6.8 sets each size apart; the kernel follows that line unless "inherit".
        own = _THP / f"hugepages-{size // 1024}kB" / "enabled"
        if own.is_file() and "[inherit]" not in (mode := own.read_text()):
            enabled = mode
    except (OSError, ValueError):
        return None
    if "[never]" in enabled or size <= PAGE or size % PAGE:
        return None
    return size


def advise_huge_pages(mapping: mmap.mmap, start: int, length: int) -> bool:
    """Ask for huge pages under ``length`` bytes of ``mapping`` from ``start``; whether the
    kernel took the advice (it refuses where THP was switched off since, or on memory it
    cannot back with huge pages; the memory then keeps 4 KiB pages and works the same)."""
    if length <= 0 or getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return False
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, length)
    except OSError:
        return False
    return True


def map_huge_aligned(size: int, aligned_at: int, huge: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping and the offset ``start`` in it of a ``size``-byte region
    whose byte ``aligned_at`` starts a huge page; the whole huge pages of the region from
    there on are asked for (:func:`advise_huge_pages`), none of it touched yet.

    The mapping is one huge page larger than ``size`` so that the region can be placed
    where it aligns; the bytes around it are never touched and cost address space only.
    Where the kernel took the advice, the whole region is registered (:func:`covers`);
    the caller takes it out (:func:`unregister_mapping`)
    before it unmaps the mapping, or the registry does once the mapping is collected
    unclosed (its address may then be reused by memory on 4 KiB pages).
    """
    mapping = mmap.mmap(-1, size + huge, flags=PRIVATE_ANONYMOUS)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        start = (-(address + aligned_at)) % huge
        first = start + aligned_at
        whole = (start + size - first) // huge * huge
        if advise_huge_pages(mapping, first, whole):
            # Never a huge page around those (the region's first part and last part, the
            # room left by the placement): under THP "always" touching the region's last
            # part would fault in a whole one there, mostly outside the region.
            for around, length in ((0, first), (first + whole, size + huge - first - whole)):
                with contextlib.suppress(OSError):  # advice only, as above
                    mapping.madvise(mmap.MADV_NOHUGEPAGE, around, length)
            # The whole region, not only its whole huge pages: a buffer in it has at most
            # its head before ``aligned_at`` (a chunk's header page, where the native tier
            # reads a whole chunk file into it) and its final partial huge page in 4 KiB
            # pages.
            listed = address + start
            register(listed, size)
            _registered[id(mapping)] = (
                weakref.finalize(mapping, _collected, id(mapping), listed),
                listed,
                size,
            )
    except BaseException:
        mapping.close()
        raise
    return mapping, start


# The registry: the starts and ends of address ranges, sorted by start, none overlapping while
# each owner unregisters its memory before unmapping it (only then can the address be reused).
_starts: list[int] = []
_ends: list[int] = []
_registry_lock = threading.Lock()
_registered: dict[int, tuple[weakref.finalize[[int, int], mmap.mmap], int, int]] = {}
"""What :func:`map_huge_aligned` registered, by ``id`` of its mapping: the finalizer that
takes the range out if the mapping is collected unclosed, and the range."""
_collected_ranges: collections.deque[int] = collections.deque()
"""Starts of ranges whose mappings the garbage collector took (with the range still
registered), taken out of the registry by its next call."""


def _collected(key: int, start: int) -> None:
    # The mapping was collected unclosed. This runs wherever the garbage collector does,
    # possibly inside a registry call on this thread holding the lock: it only queues.
    _registered.pop(key, None)
    _collected_ranges.append(start)


def _take_out_collected() -> None:
    """Take the ranges of collected mappings out (the caller holds the lock)."""
    while _collected_ranges:
        start = _collected_ranges.popleft()
        at = bisect.bisect_left(_starts, start)
        if at < len(_starts) and _starts[at] == start:
            del _starts[at], _ends[at]


def register(address: int, length: int) -> None:
    """List ``length`` bytes at ``address`` as memory whose huge pages were asked for."""
    if length <= 0:
        return
    with _registry_lock:
        _take_out_collected()
        at = bisect.bisect_right(_starts, address)
        _starts.insert(at, address)
        _ends.insert(at, address + length)


def unregister(address: int, length: int) -> None:
    """Take every registered range that lies within ``length`` bytes at ``address`` out of the
    registry (call it before unmapping that memory: the address may be reused); none is no
    error."""
    end = address + length
    with _registry_lock:
        _take_out_collected()
        low = bisect.bisect_left(_starts, address)
        high = bisect.bisect_left(_starts, end, lo=low)
        keep = [i for i in range(low, high) if _ends[i] > end]
        _starts[low:high] = [_starts[i] for i in keep]
        _ends[low:high] = [_ends[i] for i in keep]


def unregister_mapping(mapping: mmap.mmap) -> None:
    """:func:`unregister` the whole of ``mapping`` (call it before closing it; a mapping
    already closed loses what :func:`map_huge_aligned` registered for it)."""
    registration = _registered.pop(id(mapping), None)
    if registration is not None:
        finalizer, start, length = registration
        finalizer.detach()
        unregister(start, length)
    if not mapping.closed:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        unregister(address, len(mapping))


def covers(address: int, length: int) -> bool:
    """Whether ``length`` bytes at ``address`` lie within one registered range: memory whose
    huge pages were asked for (the kernel may still back some of it with 4 KiB pages where
    it found no free huge page)."""
    with _registry_lock:
        _take_out_collected()
        at = bisect.bisect_right(_starts, address) - 1
        return at >= 0 and _ends[at] >= address + length
