"""Transparent huge pages for memory that the filesystem store reads and writes with ``O_DIRECT``.

An ``O_DIRECT`` transfer of a 2 MiB chunk from memory in scattered 4 KiB pages
reaches the block device as 513 physical segments; a virtio disk that takes at
most 254 segments a request (``/sys/block/*/queue/max_segments``) then splits
every chunk into three requests. From memory backed by huge pages the same
chunk is one or two physically contiguous pieces, one request. Both the
native vLLM tier's chunk buffers (:mod:`chunkstore.vllm.native.buffers`) and
the host cache's private slot pool (:mod:`chunkstore.cache._pool`) map their
memory here.

The kernel gives huge pages only to *private* anonymous memory in THP
``madvise`` mode, and only where the range was ``madvise(MADV_HUGEPAGE)``-d
before its first touch: a 4 KiB page faulted in first keeps its huge page from
forming. Shared anonymous memory and ``/dev/shm`` files are shmem, which gets
huge pages only under ``shmem_enabled`` (often ``never``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from functools import cache
from pathlib import Path

__all__ = ["advise_huge_pages", "huge_page_size", "map_huge_aligned"]

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
    except BaseException:
        mapping.close()
        raise
    return mapping, start
