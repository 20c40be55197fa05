"""A preallocated pool of fixed-size slots, private or in named shared memory.

Layout of the mapping (all integers little-endian)::

    header (4096 B)  magic "CSPOOL01" | version u32 | 0 u32 | slot_size u64 |
                     slot_stride u64 | num_slots u64 | table_offset u64 |
                     data_offset u64 | owner_pid u64
                     (at offset 1024: rank table, 64 x pid i64)
    slot table       num_slots x 128 B: state u32 | pins u32 | length u64 |
                     generation u64 | namespace 8 B | digest 32 B |
                     tp u32 | claimer u32 | joined u64 | done u64 | writers u64 |
                     claimed_at f64 | 24 B reserved
    slots            num_slots x slot_stride B, each 4096-byte aligned

What is shared, and how races are avoided:

* One process **owns** the pool: the one that created it, in vLLM the scheduler.
  Only the owner runs the replacement policy and decides which key lives in which slot.
  So assignment needs no cross-process agreement.
  The one exception is explicit: slots the owner *lends* to TP rank processes.
  Those claim them per key among themselves, see below.
* The **slot table** is shared.
  Every process can find a key's slot with :meth:`SlotPool.find`.
  It can pin a slot for reading with :meth:`SlotPool.acquire`.
  It can write into a slot the owner reserved for it with :meth:`SlotPool.writable`.
* Every change to the table happens under the pool lock: state, pins, key, generation.
  The lock is a ``threading.RLock`` inside a process plus ``flock`` on the shared-memory
  file across processes.
  Slot *payloads* are copied without the lock, and the state word makes that safe.
  A ``READY`` slot is never reassigned while its pin count is non-zero.
  A ``WRITING`` slot is invisible to readers until the owner publishes it.
* ``generation`` grows on every reassignment.
  So a stale slot number handed to another process is detected.
  It never writes into someone else's chunk.
* Limit: read pins held by a process that crashes are never released.
  Such slots stay out of use until the pool is recreated.
  Shard writers of a TP claim are tracked per rank instead, so a crashed writer is detected.
  See :mod:`chunkstore.cache.assembly`.
* The claim fields, ``tp`` to ``claimed_at``, belong to TP shard assembly.
  So do the states ``LENT`` to ``ABORTED``, see :mod:`chunkstore.cache.assembly`.
  The owner lends free slots, and rank processes claim one per key.
  They write their shards into it and seal it, and the owner adopts the sealed chunk.

Pinning page-locks memory for fast device copies.
It uses ``cudaHostRegister`` through torch when torch and CUDA are present.
Otherwise the pool is plain memory and everything else works the same.

Huge pages, see :mod:`chunkstore._hugepages`.
A pool without a name is private anonymous memory that only its own process maps.
The kernel may give transparent huge pages to ``madvise``-d memory.
Then the mapping is one huge page larger, and the pool is placed so its slot data
starts a huge page.
The slot data is advised before anything touches it.
The header and table stay on 4 KiB pages in front of it.
Slots then lie on a few physically contiguous pieces.
So ``O_DIRECT`` reads and writes of the filesystem store reach the disk as one request
per chunk instead of several.
See docs/benchmarks.md, "Host slots on huge pages".
The header records the same offsets either way.
A named pool keeps its layout, since other processes read it.
Its slot data is advised too.
That only matters where ``/dev/shm`` gets huge pages at all, per ``shmem_enabled``.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import numpy as np

from chunkstore._hugepages import (
    PRIVATE_ANONYMOUS,
    advise_huge_pages,
    huge_page_size,
    map_huge_aligned,
    unregister_mapping,
)
from chunkstore.errors import ConfigError, MissingDependency, StoreError
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)

MAGIC = b"CSPOOL01"
VERSION = 2
PAGE = 4096
HEADER_SIZE = PAGE
_HEADER = struct.Struct("<8sIIQQQQQQ")
RANK_TABLE_OFFSET = 1024
MAX_RANKS = 64
"""Most TP ranks one pool can assemble chunks for (one bit each in ``joined``/``done``)."""

FREE, WRITING, READY, DOOMED = 0, 1, 2, 3
"""Slot states. DOOMED is deleted or replaced while pinned. It is freed when the last pin goes."""
LENT, CLAIMED, SEALING, SEALED, ABORTED = 4, 5, 6, 7, 8
"""TP assembly states, in order.
A slot is lent to rank processes by the owner, then claimed for a key.
Its last writer then seals it, and it waits sealed for the owner to adopt it.
A slot given up is freed by the owner once no writer is still inside it."""

ENTRY = np.dtype(
    [
        ("state", "<u4"),
        ("pins", "<u4"),
        ("length", "<u8"),
        ("generation", "<u8"),
        ("namespace", "u1", (8,)),
        ("digest", "u1", (32,)),
        ("tp", "<u4"),
        ("claimer", "<u4"),
        ("joined", "<u8"),
        ("done", "<u8"),
        ("writers", "<u8"),
        ("claimed_at", "<f8"),
        ("reserved", "u1", (24,)),
    ]
)
assert ENTRY.itemsize == 128

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class StaleSlot(StoreError):
    """A slot number no longer holds what the caller was told (reassigned or not reserved)."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class SlotPool:
    """``num_slots`` slots of ``slot_size`` bytes in one mapping. See the module docstring.

    The owner builds one with :meth:`create`. Another process uses :meth:`attach`.
    """

    def __init__(
        self,
        mapping: mmap.mmap,
        *,
        fd: int | None,
        name: str | None,
        owner: bool,
        pin_memory: bool | None,
        offset: int = 0,
    ) -> None:
        # ``offset``: where the pool starts in ``mapping`` (a private pool is placed so that
        # its slot data starts a huge page; a shared one always starts the mapping).
        self._mmap = mapping
        self._fd = fd
        self.name = name
        """Shared-memory name (``/dev/shm/<name>``), or ``None`` for a private pool."""
        self.owner = owner
        """Whether this process created the pool (and unlinks it on close)."""
        magic, version, _, slot_size, stride, num_slots, table_off, data_off, owner_pid = (
            _HEADER.unpack_from(mapping, offset)
        )
        if magic != MAGIC:
            raise StoreError(f"shared memory {name!r} is not a chunkstore slot pool")
        if version != VERSION:
            raise StoreError(
                f"slot pool {name!r} has version {version}; this reader knows {VERSION}"
            )
        self.slot_size: int = slot_size
        """Usable bytes per slot (the chunk size)."""
        self.slot_stride: int = stride
        """Distance between slot starts (slot_size rounded up to 4096)."""
        self.num_slots: int = num_slots
        """Number of slots."""
        self.owner_pid: int = owner_pid
        """Process id of the creator."""
        self._data_offset = offset + data_off
        self._buf = memoryview(mapping)
        table = np.ndarray((num_slots,), dtype=ENTRY, buffer=mapping, offset=offset + table_off)
        self.table = table
        """The shared slot table, a structured array of one :data:`ENTRY` per slot.
        Read it under the pool lock. Only the owner and the assembly protocol write it."""
        self.rank_pids = np.ndarray(
            (MAX_RANKS,), dtype="<i8", buffer=mapping, offset=offset + RANK_TABLE_OFFSET
        )
        """Process id of each attached TP rank (0: none), for detecting crashed writers."""
        # Per-field views, taken once: scalar reads on them cost ~100 ns, not a dict lookup.
        self._state = table["state"]
        self._pins = table["pins"]
        self._length = table["length"]
        self._generation = table["generation"]
        self._namespace = table["namespace"]
        self._digest = table["digest"]
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._closed = False
        self._unpin: Callable[[], None] | None = None
        self.pinned = False
        """Whether the pool is page-locked for the accelerator."""
        if pin_memory is not False:
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping, offset))
            size = data_off + num_slots * stride  # the pool, not the slack around a private one
            self._unpin = _page_lock(address, size, required=pin_memory is True)
            self.pinned = self._unpin is not None
        # The owner's name must not outlive its process: an owner that is garbage-collected or
        # exits without close() still removes /dev/shm/<name> (kill -9 is left to `replace`).
        self._remove_name: weakref.finalize[[Path, int], SlotPool] | None = None
        if owner and name is not None:
            self._remove_name = weakref.finalize(
                self, _remove_shm_name, _shm_path(name), os.getpid()
            )

    # --- construction -------------------------------------------------------------

    @classmethod
    def create(
        cls,
        slot_size: int,
        num_slots: int,
        *,
        name: str | None = None,
        pin_memory: bool | None = None,
        replace: bool = False,
    ) -> SlotPool:
        """A new pool. ``name`` puts it in ``/dev/shm/<name>`` for other processes to attach.

        With ``pin_memory=None`` it pins when torch sees CUDA.
        ``True`` requires pinning, and ``False`` never pins.
        ``replace`` removes a leftover pool of the same name instead of refusing to start.
        A crashed owner leaves such a pool.
        """
        if slot_size < 1 or num_slots < 1:
            raise ConfigError(
                f"a slot pool needs slot_size >= 1 and num_slots >= 1 "
                f"(got {slot_size} and {num_slots})"
            )
        stride = _round_up(slot_size, PAGE)
        table_offset = HEADER_SIZE
        data_offset = _round_up(table_offset + num_slots * ENTRY.itemsize, PAGE)
        size = data_offset + num_slots * stride
        fd: int | None = None
        path: Path | None = None
        offset = 0
        if name is None:
            mapping, offset = _private_mapping(size, data_offset)
        else:
            path = _shm_path(name)
            if replace:
                path.unlink(missing_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise StoreError(
                    f"shared pool {name!r} already exists ({path}): another owner is running, "
                    f"or a crashed one left it behind (remove the file or pass replace=True)"
                ) from None
            try:
                # fallocate reserves the pages now: a too-small /dev/shm fails here with a
                # clear error instead of SIGBUS on the first write into a late slot.
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
                # Huge pages for the slot data where /dev/shm gives them to advised memory
                # (shmem_enabled "advise"; with "always" it does anyway, with "never" not at
                # all). Untested on a host that has them: see docs/limits.md.
                advise_huge_pages(mapping, data_offset, size - data_offset)
            except OSError as exc:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise StoreError(
                    f"cannot allocate {size} bytes of shared memory for pool {name!r}: "
                    f"{exc.strerror} (is /dev/shm large enough?)"
                ) from None
        _HEADER.pack_into(
            mapping,
            offset,
            MAGIC,
            VERSION,
            0,
            slot_size,
            stride,
            num_slots,
            table_offset,
            data_offset,
            os.getpid(),
        )
        try:
            return cls(mapping, fd=fd, name=name, owner=True, pin_memory=pin_memory, offset=offset)
        except BaseException:
            # (Pinning that is required and fails, say.) The mapping goes with the GC; the
            # registry must not outlive it, nor a named pool its descriptor and name (the
            # next start would find the name taken).
            unregister_mapping(mapping)
            if fd is not None:
                os.close(fd)
            if path is not None:
                path.unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, name: str, *, pin_memory: bool | None = False) -> SlotPool:
        """Open the pool another process created under ``name``.

        Attachers do not pin by default: a TP worker that copies to the device
        passes ``pin_memory=None`` to register the mapping in its own process.
        """
        path = _shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise StoreError(f"no shared pool named {name!r} ({path} does not exist)") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise StoreError(f"shared memory {name!r} is too small to be a slot pool")
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
            return cls(mapping, fd=fd, name=name, owner=False, pin_memory=pin_memory)
        except BaseException:
            os.close(fd)
            raise

    # --- locking ----------------------------------------------------------------------

    def __enter__(self) -> SlotPool:
        """Hold the pool lock (re-entrant within a thread)."""
        self._thread_lock.acquire()
        if self._depth == 0 and self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except BaseException:
                self._thread_lock.release()
                raise
        self._depth += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self._depth == 0 and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    # --- slot access ---------------------------------------------------------------------

    def view(self, slot: int) -> memoryview:
        """The whole slot (``slot_size`` bytes), writable. No lock: callers hold a pin."""
        start = self._data_offset + slot * self.slot_stride
        return self._buf[start : start + self.slot_size]

    def state(self, slot: int) -> int:
        """The slot's state word (FREE, WRITING, READY, DOOMED)."""
        return int(self._state[slot])

    def pins(self, slot: int) -> int:
        """How many readers/writers currently hold the slot."""
        return int(self._pins[slot])

    def length(self, slot: int) -> int:
        """Bytes of chunk data in the slot."""
        return int(self._length[slot])

    def generation(self, slot: int) -> int:
        """How many times the slot has been assigned."""
        return int(self._generation[slot])

    def key_of(self, slot: int) -> ChunkKey | None:
        """The key stored in a WRITING/READY/DOOMED slot's table entry."""
        if self._state[slot] == FREE:
            return None
        return ChunkKey(self._digest[slot].tobytes(), self._namespace[slot].tobytes().hex())

    def pinned_slots(self) -> int:
        """Slots with at least one pin (all processes)."""
        return int(np.count_nonzero(self._pins))

    def data_region(self) -> memoryview:
        """The slot area: one buffer that contains every slot view and never moves.

        What a transfer engine (NIXL) registers once so it can read and write
        any slot without a staging copy.
        """
        end = self._data_offset + self.num_slots * self.slot_stride
        return self._buf[self._data_offset : end]

    def slot_offset(self, slot: int) -> int:
        """Byte offset of ``slot`` inside :meth:`data_region`."""
        return slot * self.slot_stride

    # --- owner-side transitions (caller holds the lock) ------------------------------------

    def assign(self, slot: int, key: ChunkKey) -> int:
        """FREE -> WRITING for ``key``, pinned once by the caller. Returns the new generation."""
        self._digest[slot] = np.frombuffer(key.digest, np.uint8)
        self._namespace[slot] = np.frombuffer(bytes.fromhex(key.namespace), np.uint8)
        self._length[slot] = 0
        self._pins[slot] = 1
        self._generation[slot] += 1
        self._state[slot] = WRITING
        return int(self._generation[slot])

    def publish(self, slot: int, length: int) -> None:
        """WRITING -> READY holding ``length`` bytes."""
        self._length[slot] = length
        self._state[slot] = READY

    def doom(self, slot: int) -> None:
        """READY/WRITING -> DOOMED: invisible to lookups, freed once unpinned."""
        self._state[slot] = DOOMED

    def free(self, slot: int) -> None:
        """Any -> FREE. The caller guarantees nobody holds a pin."""
        self._state[slot] = FREE
        self._pins[slot] = 0
        self._length[slot] = 0

    def lend(self, slot: int) -> None:
        """FREE/ABORTED -> LENT: claimable by TP rank processes (claim fields cleared)."""
        entry = self.table[slot]
        entry["tp"] = entry["claimer"] = 0
        entry["joined"] = entry["done"] = entry["writers"] = 0
        entry["claimed_at"] = 0.0
        self._pins[slot] = 0
        self._length[slot] = 0
        self._generation[slot] += 1
        self._state[slot] = LENT

    def pin(self, slot: int) -> None:
        """One more holder."""
        self._pins[slot] += 1

    def unpin(self, slot: int) -> int:
        """One holder fewer. Returns the remaining count."""
        pins = int(self._pins[slot])
        if pins == 0:
            raise StaleSlot(f"slot {slot} released more often than acquired")
        self._pins[slot] = pins - 1
        return pins - 1

    # --- cross-process API ------------------------------------------------------------------

    def find(self, key: ChunkKey) -> int | None:
        """The READY slot holding ``key``. This scans the table; the owner keeps a dict."""
        digest = np.frombuffer(key.digest, np.uint8)
        with self:
            hits = np.flatnonzero((self._state == READY) & (self._digest == digest).all(axis=1))
            for slot in hits:
                if self._namespace[slot].tobytes().hex() == key.namespace:
                    return int(slot)
        return None

    def acquire(self, key: ChunkKey) -> tuple[int, memoryview] | None:
        """Pin ``key``'s READY slot for reading. Returns ``(slot, view of its bytes)``, or ``None``.

        Release it with :meth:`release`, in a ``finally``.
        The owner cannot evict the slot while it is pinned.
        """
        with self:
            slot = self.find(key)
            if slot is None:
                return None
            self._pins[slot] += 1
            length = int(self._length[slot])
        return slot, self.view(slot)[:length]

    def release(self, slot: int) -> None:
        """Drop a pin taken by :meth:`acquire` (the owner frees DOOMED slots later)."""
        with self:
            self.unpin(slot)

    def writable(self, slot: int, generation: int) -> memoryview:
        """The slot the owner reserved, for in-place writes.
        It is in state WRITING, at this generation.

        A TP worker process writes its shard here, and the owner then commits.
        The owner's reservation pin keeps the slot in place until then.
        """
        with self:
            if self._state[slot] != WRITING or int(self._generation[slot]) != generation:
                raise StaleSlot(
                    f"slot {slot} is not reserved at generation {generation} "
                    f"(state {int(self._state[slot])}, generation {int(self._generation[slot])})"
                )
        return self.view(slot)

    # --- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap (and, for the owner, remove the shared-memory name). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        for attr in (
            "_state",
            "_pins",
            "_length",
            "_generation",
            "_namespace",
            "_digest",
            "table",
            "rank_pids",
        ):
            setattr(self, attr, None)
        # Before the unmap: the registry must not vouch for whatever is mapped here next.
        unregister_mapping(self._mmap)
        self._buf.release()
        try:
            self._mmap.close()
        except BufferError:
            # A caller still holds a slot view; the mapping goes when that view does.
            log.debug("slot pool %s: views still exported; unmapping deferred to GC", self.name)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._remove_name is not None:
            self._remove_name()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def __repr__(self) -> str:
        where = f"/dev/shm/{self.name}" if self.name else "private"
        return f"SlotPool({where}, slots={self.num_slots}, slot_size={self.slot_size})"


def _remove_shm_name(path: Path, creator_pid: int) -> None:
    # A process forked from the owner inherits the finalizer; only the creator removes the name.
    if os.getpid() == creator_pid:
        path.unlink(missing_ok=True)


def _shm_path(name: str) -> Path:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"invalid shared pool name {name!r}: use letters, digits, '_', '.', '-'")
    if not SHM_DIR.is_dir():
        raise ConfigError(
            "shared slot pools need /dev/shm (Linux); omit the name for a private pool"
        )
    return SHM_DIR / name


def _private_mapping(size: int, data_offset: int) -> tuple[mmap.mmap, int]:
    """Memory for an unnamed pool of ``size`` bytes, and where the pool starts in it.

    The memory is private: only this process maps it.
    The pool is placed so that its slot data, from ``data_offset``, starts a huge page.
    That holds where the kernel has huge pages for advised memory.
    See :mod:`chunkstore._hugepages`.

    It is private, not shared anonymous memory.
    Shared anonymous memory is shmem, which gets no huge pages where ``shmem_enabled`` is
    ``never``.
    And a process forked from the owner gets a copy of the pool, not a second writer.
    Nothing shares an unnamed pool across a fork.
    Processes that share a pool attach it by name.
    """
    huge = huge_page_size()
    if huge is None or size - data_offset < huge:
        return mmap.mmap(-1, size, flags=PRIVATE_ANONYMOUS), 0
    return map_huge_aligned(size, data_offset, huge)


def _page_lock(address: int, size: int, *, required: bool) -> Callable[[], None] | None:
    """Register ``size`` bytes at ``address`` with CUDA as pinned host memory.
    Returns the undo, or None."""
    try:
        import torch
    except ImportError:
        if required:
            raise MissingDependency(
                "pinned host pools need torch with CUDA: pip install torch (or pin_memory=False)"
            ) from None
        return None
    if not torch.cuda.is_available():
        if required:
            raise ConfigError("pin_memory=True but torch sees no CUDA device")
        return None
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    status = cudart.cudaHostRegister(address, size, 0)
    if int(status) != 0:
        if required:
            raise StoreError(f"cudaHostRegister failed for {size} bytes (error {int(status)})")
        log.warning("host pool not pinned: cudaHostRegister returned %s", int(status))
        return None

    def unregister() -> None:
        cudart.cudaHostUnregister(address)

    return unregister
