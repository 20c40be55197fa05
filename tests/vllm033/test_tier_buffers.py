"""ChunkBuffers: reused page-aligned buffers, held back while an abandoned call may use them."""

from __future__ import annotations

import ctypes
import mmap
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from chunkstore import _hugepages
from chunkstore._hugepages import PAGE
from chunkstore.tiering import ChunkBuffers
from chunkstore.tiering import _buffers as buffers


def _address(buffer) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _huge_page_eligible(address: int) -> bool:
    """Whether the kernel may back the page at ``address`` with a huge page (``THPeligible``
    of the mapping that holds it, in /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


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


def test_a_buffer_of_a_huge_page_or_more_starts_its_payload_on_one(monkeypatch):
    huge = buffers.huge_page_size()
    if huge is None:
        pytest.skip("no transparent huge pages on this machine")
    pool = ChunkBuffers(huge + 3 * PAGE, keep=2, huge_at=PAGE)
    assert pool.huge_pages
    taken = pool.take(2)
    for buffer in taken:
        assert len(buffer) == huge + 3 * PAGE and not buffer.readonly
        assert _address(buffer) % PAGE == 0  # still page-aligned for O_DIRECT as a whole
        assert (_address(buffer) + PAGE) % huge == 0  # the payload starts a huge page
        buffer[:] = b"\x5a" * len(buffer)  # every byte is usable
    mappings = [b.obj for b in taken]
    pool.give(taken)
    assert all(any(a is b for b in taken) for a in pool.take(2))  # reused as they are
    pool.close()
    assert all(not m.closed for m in mappings)  # taken again, so not unmapped by close


def test_buffers_on_huge_pages_are_listed_until_unmapped():
    # The fs store reads a large cold chunk O_DIRECT only into listed memory.
    huge = buffers.huge_page_size()
    if huge is None:
        pytest.skip("no transparent huge pages on this machine")
    pool = ChunkBuffers(huge + PAGE, keep=1, huge_at=PAGE)
    taken = pool.take(2)
    # Whole: the fs store reads a chunk file (header page and payload) into the buffer.
    payloads = [(_address(b), huge + PAGE) for b in taken]
    assert all(_hugepages.covers(*span) for span in payloads)
    pool.give(taken)  # one kept idle, one unmapped
    assert [_hugepages.covers(*span) for span in payloads] == [True, False]
    pool.close()
    assert not any(_hugepages.covers(*span) for span in payloads)

    plain = ChunkBuffers(huge // 2, keep=1)
    (buffer,) = plain.take(1)
    assert not _hugepages.covers(_address(buffer), len(buffer))
    plain.close()


def test_small_buffers_and_hosts_without_huge_pages_get_plain_pages(monkeypatch, tmp_path):
    huge = buffers.huge_page_size() or 2 << 20
    small = ChunkBuffers(huge // 2, keep=1, huge_at=PAGE)
    assert not small.huge_pages
    (buffer,) = small.take(1)
    assert len(buffer) == huge // 2 and _address(buffer) % PAGE == 0
    small.give([buffer])
    small.close()

    (tmp_path / "enabled").write_text("always madvise [never]\n")
    (tmp_path / "hpage_pmd_size").write_text(f"{huge}\n")
    monkeypatch.setattr(_hugepages, "_THP", tmp_path)
    _hugepages.huge_page_size.cache_clear()
    try:
        assert buffers.huge_page_size() is None
        pool = ChunkBuffers(2 * huge, keep=1, huge_at=PAGE)
        assert not pool.huge_pages
        (buffer,) = pool.take(1)
        assert len(buffer) == 2 * huge and _address(buffer) % PAGE == 0
        pool.close()
    finally:
        _hugepages.huge_page_size.cache_clear()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no huge pages on this system")
@pytest.mark.parametrize(
    ("overall", "own", "given"),
    [
        ("always madvise [never]", "always inherit [madvise] never", True),
        ("always [madvise] never", "always inherit madvise [never]", False),
        ("always [madvise] never", "always [inherit] madvise never", True),
        ("always madvise [never]", "always [inherit] madvise never", False),
    ],
)
def test_the_huge_page_size_has_its_own_setting_where_the_kernel_has_one(
    monkeypatch, tmp_path, overall, own, given
):
    # Linux 6.8 and later set each huge page size apart, and the line for the size (unless
    # "inherit") is the one the kernel follows: huge pages are given with THP "never" above
    # it, and none with "madvise" above a size set to "never".
    (tmp_path / "enabled").write_text(f"{overall}\n")
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    (tmp_path / "hugepages-2048kB").mkdir()
    (tmp_path / "hugepages-2048kB" / "enabled").write_text(f"{own}\n")
    # (The module that reads the settings, wherever huge_page_size lives.)
    monkeypatch.setattr(sys.modules[buffers.huge_page_size.__module__], "_THP", tmp_path)
    buffers.huge_page_size.cache_clear()
    try:
        assert buffers.huge_page_size() == (2 << 20 if given else None)
    finally:
        buffers.huge_page_size.cache_clear()


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no huge pages on this system")
def test_the_kernel_refusing_huge_pages_leaves_a_working_buffer(monkeypatch):
    # Refused where THP was switched off after start-up, or for this process (prctl): on any
    # host, whatever its own THP mode, as the pool is told there are huge pages.
    huge = buffers.huge_page_size() or 2 << 20
    monkeypatch.setattr(buffers, "huge_page_size", lambda: huge)
    pool = ChunkBuffers(huge + PAGE, keep=1, huge_at=PAGE)
    assert pool.huge_pages
    real = mmap.mmap

    class Refusing(real):  # type: ignore[misc, valid-type]
        def madvise(self, option, start=0, length=None):
            if option == mmap.MADV_HUGEPAGE:
                raise OSError(22, "Invalid argument")
            return super().madvise(option, start, length if length is not None else len(self))

    monkeypatch.setattr(buffers.mmap, "mmap", Refusing)
    (buffer,) = pool.take(1)
    buffer[:] = b"\x01" * len(buffer)
    assert bytes(buffer[-1:]) == b"\x01"
    pool.close()


def test_the_room_around_a_buffers_huge_pages_never_becomes_one(monkeypatch):
    # THP "always" (RHEL's default) makes every anonymous mapping eligible, the room that
    # placing a buffer leaves in its mapping too: there the first touch of the buffer's last
    # part faulted in a whole huge page, mostly outside the buffer (measured with every
    # mapping eligible: 5 in 100 tier-sized buffers, 1.9 MiB each). The host's mode is not
    # the test's to change, so each new mapping is made eligible whole, as "always" makes it.
    huge = buffers.huge_page_size()
    if huge is None:
        pytest.skip("no transparent huge pages on this machine")
    real = mmap.mmap

    class EligibleWhole(real):  # type: ignore[misc, valid-type]
        def __new__(cls, *args, **kwargs):
            mapping = super().__new__(cls, *args, **kwargs)
            mapping.madvise(mmap.MADV_HUGEPAGE)
            return mapping

    monkeypatch.setattr(buffers.mmap, "mmap", EligibleWhole)
    # The payload (from PAGE on) fills one huge page and all but a page of the next.
    pool = ChunkBuffers(2 * huge, keep=1, huge_at=PAGE)
    (buffer,) = pool.take(1)
    mapping = buffer.obj
    base, start = _address(mapping), _address(buffer)
    payload = start + PAGE
    assert _huge_page_eligible(payload) and _huge_page_eligible(payload + huge - PAGE)
    for outside in (base, start, payload + huge, base + len(mapping) - PAGE):
        assert not _huge_page_eligible(outside), hex(outside - base)
    pool.close()


def test_the_fs_store_reads_large_cold_chunks_direct_into_buffers_on_huge_pages(
    tmp_path, monkeypatch
):
    huge = buffers.huge_page_size()
    if huge is None:
        pytest.skip("no transparent huge pages on this machine")
    from chunkstore.backends import _fastread as fastread
    from chunkstore.backends._fastread import ChunkFileReader
    from chunkstore.backends._fs import FsStore
    from chunkstore.testing.factories import sample_chunks
    from tests.cache.conftest import LAYOUT

    monkeypatch.setattr(fastread, "READAHEAD_FROM", 0)  # every chunk counts as large
    monkeypatch.setattr(ChunkFileReader, "_cached", lambda self: False)  # every file cold
    chunks = sample_chunks(2, seed=5, layout=LAYOUT)
    # As the tier maps them: the payload, after the header page, starts a huge page.
    pool = ChunkBuffers(huge + PAGE, keep=2, huge_at=LAYOUT.data_offset)
    disk = FsStore(str(tmp_path / "disk"), create=True, read_mode="auto", io_workers=1)
    try:
        disk.put_many([(c.key, c.data) for c in chunks])
        taken = pool.take(2)
        assert disk.get_many_into([c.key for c in chunks], taken) == [LAYOUT.total_size] * 2
        assert [bytes(b[: LAYOUT.total_size]) for b in taken] == [c.data for c in chunks]
        stats = disk.io_stats()
        if stats.mode == "auto":  # the filesystem takes O_DIRECT (tmpfs does not)
            assert (stats.direct_reads, stats.cold_reads) == (2, 0)  # not read ahead
        pool.give(taken)
    finally:
        disk.close()
        pool.close()
