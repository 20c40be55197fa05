"""The slot pool's memory: private pools on huge pages, named pools as before, pinning."""

from __future__ import annotations

import ctypes
import gc
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from chunkstore import _hugepages
from chunkstore.backends import _fastread as fastread
from chunkstore.backends._fastread import ChunkFileReader
from chunkstore.backends._fs import FsStore
from chunkstore.cache import HostCache, SlotPool
from chunkstore.cache._pool import ENTRY, HEADER_SIZE, PAGE, SHM_DIR
from chunkstore.errors import ChunkStoreError
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT

HUGE = _hugepages.huge_page_size()
needs_thp = pytest.mark.skipif(HUGE is None, reason="no transparent huge pages on this machine")
SLOT = (2 << 20) + PAGE
"""A 2 MiB chunk file: payload plus one header page."""


def _address(buffer: object) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _covered(view: memoryview) -> bool:
    """Whether ``view`` is listed as on huge pages (read O_DIRECT however large)."""
    return _hugepages.covers(_address(view), len(view))


def _data_offset(num_slots: int) -> int:
    """Where the slot data starts after the header and table (spec of the pool's layout)."""
    return -(-(HEADER_SIZE + num_slots * ENTRY.itemsize) // PAGE) * PAGE


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    flags: list[str] | None = None
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


@pytest.fixture
def without_thp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A sysfs whose THP setting is ``never``."""
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    (tmp_path / "hpage_pmd_size").write_text(f"{2 << 20}\n")
    monkeypatch.setattr(_hugepages, "_THP", tmp_path)
    _hugepages.huge_page_size.cache_clear()
    yield
    _hugepages.huge_page_size.cache_clear()


@needs_thp
def test_a_private_pool_starts_its_slot_data_on_an_advised_huge_page() -> None:
    assert HUGE is not None
    pool = SlotPool.create(SLOT, 3, pin_memory=False)
    try:
        region = pool.data_region()
        start = _address(region)
        assert start % HUGE == 0 and len(region) == 3 * SLOT
        assert "hg" in _vm_flags(start)  # MADV_HUGEPAGE, asked before the first touch
        for slot in range(3):
            view = pool.view(slot)
            assert len(view) == SLOT and _address(view) % PAGE == 0
            view[:] = bytes([slot + 1]) * SLOT
        assert [bytes(pool.view(s)[-1:]) for s in range(3)] == [b"\x01", b"\x02", b"\x03"]
        # The header and table sit in front of the slot data, where the layout puts them.
        assert start - _address(pool.table) == _data_offset(3) - HEADER_SIZE
        region.release()
    finally:
        pool.close()


@needs_thp
def test_a_private_pool_smaller_than_a_huge_page_is_mapped_exactly() -> None:
    pool = SlotPool.create(PAGE, 4, pin_memory=False)
    try:
        assert len(pool._mmap) == _data_offset(4) + 4 * PAGE
        assert _address(pool.view(0)) - _address(pool._mmap) == _data_offset(4)
    finally:
        pool.close()


def test_without_huge_pages_the_pool_is_mapped_as_before(without_thp: None) -> None:
    assert _hugepages.huge_page_size() is None
    pool = SlotPool.create(SLOT, 3, pin_memory=False)
    try:
        size = _data_offset(3) + 3 * SLOT
        assert len(pool._mmap) == size  # no slack mapped to align anything
        start = _address(pool.view(0))
        assert start - _address(pool._mmap) == _data_offset(3)
        assert "hg" not in _vm_flags(start)
        pool.view(2)[:] = b"\x07" * SLOT
        assert bytes(pool.view(2)[:1]) == b"\x07"
    finally:
        pool.close()


def test_a_forked_child_writes_its_own_copy_of_a_private_pool() -> None:
    pool = SlotPool.create(PAGE, 2, pin_memory=False)
    try:
        pool.view(0)[:4] = b"mine"
        child = os.fork()
        if child == 0:  # the child scribbles over slot 0, then exits without cleanup
            pool.view(0)[:4] = b"kid!"
            os._exit(0 if bytes(pool.view(0)[:4]) == b"kid!" else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert bytes(pool.view(0)[:4]) == b"mine"
    finally:
        pool.close()


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")
def test_a_named_pool_keeps_its_layout_and_advises_its_slot_data() -> None:
    name = f"chunkstore-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    pool = SlotPool.create(SLOT, 3, name=name, pin_memory=False)
    try:
        assert len(pool._mmap) == (SHM_DIR / name).stat().st_size == _data_offset(3) + 3 * SLOT
        start = _address(pool.view(0))
        assert start - _address(pool._mmap) == _data_offset(3)
        if HUGE is not None:
            assert "hg" in _vm_flags(start)
        # Not listed as on huge pages (large cold chunks read ahead into it): /dev/shm is
        # shmem, with no huge pages where shmem_enabled is "never" (here).
        assert not any(_covered(pool.view(s)) for s in range(3))
        pool.view(1)[:3] = b"abc"
        other = SlotPool.attach(name)
        try:
            assert bytes(other.view(1)[:3]) == b"abc"
        finally:
            other.close()
    finally:
        pool.close()
        (SHM_DIR / name).unlink(missing_ok=True)


class FakeCudart:
    """Records what would be page-locked (torch's cudart, on a machine without CUDA)."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:  # noqa: N802
        self.registered.append((address, size, flags))
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        self.unregistered.append(address)
        return 0


@pytest.mark.parametrize("thp", [True, False], ids=["huge-pages", "without"])
def test_pinning_registers_the_pool_and_nothing_around_it(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, thp: bool
) -> None:
    if not thp:
        request.getfixturevalue("without_thp")
    torch = pytest.importorskip("torch")
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pool = SlotPool.create(SLOT, 3, pin_memory=True)
    assert pool.pinned
    start = _address(pool.table) - HEADER_SIZE  # the header's first byte
    assert cudart.registered == [(start, _data_offset(3) + 3 * SLOT, 0)]
    pool.close()
    assert cudart.unregistered == [start]


@pytest.mark.parametrize("thp", [True, False], ids=["huge-pages", "without"])
def test_direct_io_moves_chunks_between_host_slots_and_disk(
    tmp_path: Path, request: pytest.FixtureRequest, thp: bool, chain: list[MadeChunk]
) -> None:
    if not thp:
        request.getfixturevalue("without_thp")
    # Enough slots that the slot data spans a huge page (where there are any).
    slots = (2 << 20) // LAYOUT.total_size + 2
    disk = FsStore(str(tmp_path / "disk"), create=True, read_mode="direct", write_mode="direct")
    host = HostCache(LAYOUT, num_slots=slots, pin_memory=False)
    store = TieredStore(host, [disk], metrics=ChunkstoreMetrics(CollectorRegistry()))
    try:
        assert store.put_many([(c.key, c.data) for c in chain[:4]]) == [True] * 4
        assert store.flush(timeout=30)  # written from the host slots
        host.delete_many([c.key for c in chain[:4]])
        for chunk in chain[:4]:
            lease = store.acquire(chunk.key)  # read from disk into a host slot
            assert lease is not None
            with lease:
                assert bytes(lease.view) == chunk.data
        stats = disk.io_stats()
        if stats.mode == "direct":  # the filesystem takes O_DIRECT (tmpfs does not)
            assert stats.direct_reads == 4
    finally:
        store.close()


@needs_thp
def test_a_private_pool_lists_its_slots_as_on_huge_pages_until_closed() -> None:
    pool = SlotPool.create(SLOT, 3, pin_memory=False)
    try:
        region = pool.data_region()
        assert _covered(region) and all(_covered(pool.view(s)) for s in range(3))
        # Listed from the pool's start (its header and table in 4 KiB pages, as a tier
        # buffer's header page is), not the room in front of it left by the placement.
        pool_start = _address(region) - _data_offset(3)
        assert _hugepages.covers(pool_start, _data_offset(3) + len(region))
        assert not _hugepages.covers(pool_start - 1, 1)
        spans = [(_address(region), len(region))]
        region.release()
    finally:
        pool.close()
    assert not any(_hugepages.covers(*span) for span in spans)


@needs_thp
def test_a_private_pool_that_fails_to_start_is_not_left_listed() -> None:
    listed = list(_hugepages._starts)
    # Required pinning fails here (no CUDA, or no torch) after the memory was mapped.
    with pytest.raises(ChunkStoreError):
        SlotPool.create(SLOT, 3, pin_memory=True)
    assert _hugepages._starts == listed


@needs_thp
def test_a_private_pool_dropped_unclosed_is_not_left_listed() -> None:
    listed = list(_hugepages._starts)
    pool = SlotPool.create(SLOT, 3, pin_memory=False)
    region = pool.data_region()
    span = (_address(region), len(region))
    region.release()
    del pool  # never closed: the garbage collector unmaps it
    gc.collect()
    assert not _hugepages.covers(*span)
    assert _hugepages._starts == listed


def test_pools_not_on_huge_pages_are_not_listed(without_thp: None) -> None:
    pool = SlotPool.create(SLOT, 3, pin_memory=False)
    try:
        assert not any(_covered(pool.view(s)) for s in range(3))
    finally:
        pool.close()


@pytest.mark.parametrize("thp", [True, False], ids=["huge-pages", "without"])
def test_auto_reads_large_cold_chunks_direct_only_into_slots_on_huge_pages(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    thp: bool,
    chain: list[MadeChunk],
) -> None:
    if not thp:
        request.getfixturevalue("without_thp")
    elif HUGE is None:
        pytest.skip("no transparent huge pages on this machine")
    monkeypatch.setattr(fastread, "READAHEAD_FROM", 0)  # every chunk counts as large (32 MiB)
    monkeypatch.setattr(ChunkFileReader, "_cached", lambda self: False)  # every file cold
    slots = (2 << 20) // LAYOUT.total_size + 2  # the slot data spans a huge page
    pool = SlotPool.create(LAYOUT.total_size, slots, pin_memory=False)
    disk = FsStore(str(tmp_path / "disk"), create=True, read_mode="auto", io_workers=2)
    try:
        disk.put_many([(c.key, c.data) for c in chain[:4]])
        views = [pool.view(s) for s in range(4)]
        assert disk.get_many_into([c.key for c in chain[:4]], views) == [LAYOUT.total_size] * 4
        assert [bytes(v) for v in views] == [c.data for c in chain[:4]]
        stats = disk.io_stats()
        if stats.mode == "auto":  # the filesystem takes O_DIRECT (tmpfs does not)
            # Around the page cache into huge pages; else through it with readahead.
            assert (stats.direct_reads, stats.cold_reads) == ((4, 0) if thp else (0, 4))
    finally:
        disk.close()
        pool.close()


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")
def test_a_named_pool_that_fails_to_start_leaves_no_name_and_no_fd() -> None:
    name = f"chunkstore-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fds = set(os.listdir("/proc/self/fd"))
    try:
        # Required pinning fails here (no CUDA, or no torch) after the name was created.
        with pytest.raises(ChunkStoreError):
            SlotPool.create(SLOT, 3, name=name, pin_memory=True)
        assert not (SHM_DIR / name).exists()  # the next start would find it "already exists"
        assert set(os.listdir("/proc/self/fd")) <= fds
        SlotPool.create(SLOT, 3, name=name, pin_memory=False).close()  # the name is free
    finally:
        (SHM_DIR / name).unlink(missing_ok=True)
