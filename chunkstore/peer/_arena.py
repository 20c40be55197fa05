"""A fixed block of host memory carved into variable-size allocations.

It serves what NIXL needs registered once and then reused.
That is the server's staging area, for chunks of a store that cannot pin in place.
It is also the client's receive and send buffers.
It allocates first-fit over a sorted free list.
Allocations are few and short lived, one lease each.
So simplicity beats a buddy or slab scheme here.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from chunkstore.errors import ConfigError

_ALIGN = 4096  # page aligned, so that every chunk starts where DMA engines like it


@dataclass(frozen=True, slots=True)
class Allocation:
    """One range of an arena."""

    offset: int
    """Start, in bytes from the arena's base."""
    size: int
    """Bytes requested (the reserved range is rounded up to the alignment)."""


class Arena:
    """``size`` bytes of page-aligned host memory with a thread-safe allocator."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ConfigError(f"arena size must be positive, got {size}")
        size = _round(size)
        raw = np.empty(size + _ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % _ALIGN
        self.array = raw[start : start + size]
        # Touch every page now: a first touch during a transfer would cost more than the copy.
        self.array.fill(0)
        self.size = size
        self.address = int(self.array.ctypes.data)
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self._lock = threading.Lock()
        self.used = 0

    def allocate(self, size: int) -> Allocation | None:
        """A range of ``size`` bytes, or ``None`` when no free range is large enough."""
        need = _round(max(size, 1))
        with self._lock:
            for i, (offset, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + need, length - need)
                    self.used += need
                    return Allocation(offset, size)
        return None

    def free(self, allocation: Allocation) -> None:
        """Return a range; neighbouring free ranges are merged."""
        need = _round(max(allocation.size, 1))
        with self._lock:
            self.used -= need
            i = bisect.bisect_left(self._free, (allocation.offset, 0))
            self._free.insert(i, (allocation.offset, need))
            if (
                i + 1 < len(self._free)
                and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]
            ):
                self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]

    def view(self, allocation: Allocation) -> memoryview:
        """The allocation's bytes (exactly the requested size)."""
        view: memoryview = self.array[allocation.offset : allocation.offset + allocation.size].data
        return view

    def address_of(self, allocation: Allocation) -> int:
        """Absolute address of an allocation (for NIXL descriptors)."""
        return self.address + allocation.offset

    def contains(self, address: int, size: int) -> bool:
        """Whether ``[address, address+size)`` lies inside this arena."""
        return self.address <= address and address + size <= self.address + self.size


def _round(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN
