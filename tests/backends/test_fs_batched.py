"""FsStore batches: several chunk I/Os in flight, O_DIRECT where it helps, a clean fallback."""

from __future__ import annotations

import logging
import mmap
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends import _fastread as fastread
from chunkstore.backends._fastread import ALIGN, AUTO, BUFFERED, DIRECT, ChunkFileReader
from chunkstore.backends._fs import GROUP_MAX, FsStore, _group_size, open_fs_store
from chunkstore.errors import ConfigError
from chunkstore.testing.factories import MadeChunk, sample_chunks
from chunkstore.testing.store_suite import _rekeyed, corrupt_copies
from tests.backends.test_fastread import refuse_o_direct

CHUNKS = sample_chunks(8, seed=21)


def slots(count: int, size: int) -> list[memoryview]:
    """Page-aligned buffers like a host pool's slots."""
    slot = -(-size // ALIGN) * ALIGN
    pool = memoryview(mmap.mmap(-1, slot * count))
    return [pool[i * slot : (i + 1) * slot] for i in range(count)]


def stocked(tmp_path: Path, **options: object) -> FsStore:
    store = FsStore(str(tmp_path / "s"), create=True, **options)  # type: ignore[arg-type]
    store.put_many([(c.key, c.data) for c in CHUNKS])
    return store


def read_all(store: FsStore, chunks: list[MadeChunk]) -> list[memoryview]:
    buffers = slots(len(chunks), max(len(c.data) for c in chunks))
    sizes = store.get_many_into([c.key for c in chunks], buffers)
    assert sizes == [len(c.data) for c in chunks]
    for chunk, buffer in zip(chunks, buffers):
        assert bytes(buffer[: len(chunk.data)]) == chunk.data
    return buffers


def test_batches_run_on_the_store_s_threads_and_close_stops_them(tmp_path: Path) -> None:
    store = stocked(tmp_path, io_workers=3)
    seen: set[str] = set()
    real = store._get_one

    def spy(key: object) -> object:
        seen.add(threading.current_thread().name)
        return real(key)  # type: ignore[arg-type]

    store._get_one = spy  # type: ignore[method-assign]
    got = store.get_many([c.key for c in reversed(CHUNKS)])
    assert [bytes(g) for g in got if g is not None] == [c.data for c in reversed(CHUNKS)]
    caller = threading.current_thread().name
    # the caller's thread and the store's own (never any other)
    assert seen and all(n == caller or n.startswith("chunkstore-io-") for n in seen)
    assert store._pool.started
    store.close()
    assert not store._pool.started
    seen.clear()
    assert store.get_many([c.key for c in CHUNKS])[0] is not None  # inline after close
    assert seen == {threading.current_thread().name}


def test_one_worker_stays_on_the_caller_s_thread(tmp_path: Path) -> None:
    store = stocked(tmp_path, io_workers=1)
    read_all(store, CHUNKS)
    assert not store._pool.started
    store.close()


def test_put_many_duplicates_end_with_the_last_copy(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path / "s"), create=True)
    a = CHUNKS[0]
    replaced = _rekeyed(a)
    assert store.put_many([(a.key, replaced), (a.key, a.data), (a.key, replaced)]) == [True] * 3
    assert bytes(store.get(a.key) or b"") == replaced
    store.close()


@pytest.mark.parametrize("mode", [DIRECT, AUTO, BUFFERED])
def test_every_read_mode_reads_exact_bytes(tmp_path: Path, mode: str) -> None:
    store = stocked(tmp_path, read_mode=mode)
    read_all(store, CHUNKS)
    stats = store.io_stats()
    assert stats.requested == stats.mode == mode
    assert stats.direct_reads + stats.cached_reads + stats.cold_reads == len(CHUNKS)
    if mode == DIRECT:
        assert stats.direct_reads == len(CHUNKS)
    if mode == BUFFERED:
        assert stats.direct_reads == 0
    assert f"read_mode={mode!r}" in repr(store)
    store.close()


@pytest.mark.parametrize("large", [False, True], ids=["small-goes-direct", "large-reads-ahead"])
def test_auto_reads_cold_files_without_keeping_them_in_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, large: bool
) -> None:
    store = stocked(tmp_path, read_mode=AUTO, io_workers=1)
    monkeypatch.setattr(ChunkFileReader, "_cached", lambda self: False)  # every file cold
    if large:
        monkeypatch.setattr(fastread, "READAHEAD_FROM", 0)  # every chunk counts as large
    dropped: list[int] = []
    real_fadvise = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            assert os.fstat(fd).st_size > 0  # while the file is still open
            dropped.append(fd)
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    read_all(store, CHUNKS)
    stats = store.io_stats()
    n = len(CHUNKS)
    # around the page cache (O_DIRECT), or through it and dropped after
    expected = (0, 0, n) if large else (n, 0, 0)
    assert (stats.direct_reads, stats.cached_reads, stats.cold_reads) == expected
    assert len(dropped) == (n if large else 0)
    store.close()


def test_refused_o_direct_switches_the_store_to_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = stocked(tmp_path, read_mode=DIRECT, io_workers=1)
    refuse_o_direct(monkeypatch)
    with caplog.at_level(logging.WARNING):
        read_all(store, CHUNKS)
    stats = store.io_stats()
    assert (stats.requested, stats.mode, stats.direct_reads) == (DIRECT, BUFFERED, 0)
    assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    assert "read_mode='buffered'" in repr(store)
    store.close()


def test_verified_direct_reads_still_catch_a_flipped_bit(tmp_path: Path) -> None:
    store = stocked(tmp_path, read_mode=DIRECT)
    victim = CHUNKS[2]
    path = store.path_of(victim.key)
    with open(path, "r+b") as f:
        f.seek(len(victim.data) - 1)
        last = f.read(1)
        f.seek(len(victim.data) - 1)
        f.write(bytes([last[0] ^ 0x01]))
    buffers = slots(len(CHUNKS), max(len(c.data) for c in CHUNKS))
    sizes = store.get_many_into([c.key for c in CHUNKS], buffers)
    assert sizes == [None if c is victim else len(c.data) for c in CHUNKS]
    assert store.corrupt_detected == 1
    store.close()


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="read_mode"):
        FsStore(str(tmp_path / "a"), create=True, read_mode="fast")
    with pytest.raises(ConfigError, match="io_workers"):
        FsStore(str(tmp_path / "b"), create=True, io_workers=0)
    store = open_fs_store(str(tmp_path / "c"), create=True, read_mode=BUFFERED, io_workers=2)
    assert store.io_stats().mode == BUFFERED and store.io_stats().workers == 2
    store.close()


@pytest.mark.parametrize("mode", [DIRECT, BUFFERED])
@pytest.mark.parametrize("tail", [0, 100], ids=["whole-pages", "partial-last-page"])
def test_write_modes_store_exact_bytes(tmp_path: Path, mode: str, tail: int) -> None:
    store = FsStore(str(tmp_path / "s"), create=True, write_mode=mode)
    chunk = CHUNKS[0]
    data = chunk.data if not tail else _rekeyed(chunk)
    slot = slots(1, len(data))[0]
    slot[: len(data)] = data
    assert store.put(chunk.key, slot[: len(data)])  # page-aligned, like a host slot
    assert Path(store.path_of(chunk.key)).read_bytes() == data
    assert store.io_stats().write_mode == mode
    store.close()


def test_direct_writes_fall_back_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_o_direct(monkeypatch)
    store = FsStore(str(tmp_path / "s"), create=True, write_mode=DIRECT)
    buffers = slots(len(CHUNKS), max(len(c.data) for c in CHUNKS))
    for chunk, buffer in zip(CHUNKS, buffers):
        buffer[: len(chunk.data)] = chunk.data
    assert store.put_many([(c.key, b[: len(c.data)]) for c, b in zip(CHUNKS, buffers)])
    for chunk in CHUNKS:
        assert Path(store.path_of(chunk.key)).read_bytes() == chunk.data
    store.close()


def test_read_mode_and_read_paths_are_metrics(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    from chunkstore.metrics import ChunkstoreMetrics

    registry = CollectorRegistry()
    store = stocked(tmp_path, read_mode=DIRECT, name="disk")
    ChunkstoreMetrics(registry).watch_store(store)
    read_all(store, CHUNKS[:3])

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"tier": "disk", **labels})

    assert sample("chunkstore_tier_read_mode", mode="direct") == 1.0
    assert sample("chunkstore_tier_reads_total", path="direct") == 3.0
    assert sample("chunkstore_tier_reads_total", path="cached") == 0.0
    store.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("mode", [BUFFERED, AUTO, DIRECT])
def test_grouped_reads_keep_each_chunk_s_verdict(tmp_path: Path, workers: int, mode: str) -> None:
    store = stocked(tmp_path, io_workers=workers, read_mode=mode)
    damage = {1: "bitflip", 2: "truncated", 3: "header", 6: "foreign"}
    for i, kind in damage.items():
        with open(store.path_of(CHUNKS[i].key), "wb") as f:
            f.write(corrupt_copies(CHUNKS[i])[kind])
    os.remove(store.path_of(CHUNKS[5].key))
    before = open_fds()
    buffers = slots(len(CHUNKS), max(len(c.data) for c in CHUNKS))
    sizes = store.get_many_into([c.key for c in CHUNKS], buffers)
    bad = set(damage) | {5}
    assert sizes == [None if i in bad else len(c.data) for i, c in enumerate(CHUNKS)]
    for i, (chunk, buffer) in enumerate(zip(CHUNKS, buffers)):
        if i not in bad:
            assert bytes(buffer[: len(chunk.data)]) == chunk.data
    assert store.corrupt_detected == len(damage)
    assert open_fds() == before
    store.close()


@pytest.mark.parametrize("workers", [1, 4])
def test_a_read_failing_mid_batch_is_raised_after_every_other_read_ended(
    tmp_path: Path, workers: int
) -> None:
    store = stocked(tmp_path, io_workers=workers)
    buffers = slots(len(CHUNKS), max(len(c.data) for c in CHUNKS))
    buffers[2] = buffers[2][:10]  # too small for its chunk: a caller's mistake
    before = open_fds()
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_many_into([c.key for c in CHUNKS], buffers)
    for i, (chunk, buffer) in enumerate(zip(CHUNKS, buffers)):
        if i != 2:
            assert bytes(buffer[: len(chunk.data)]) == chunk.data
    assert open_fds() == before
    store.close()


def test_a_group_starts_every_read_before_it_streams_any_payload(tmp_path: Path) -> None:
    store = stocked(tmp_path, io_workers=1)
    steps: list[str] = []
    start, finish = store._start_local, store._finish_local

    def spy_start(*args: Any) -> Any:
        steps.append("header")
        return start(*args)

    def spy_finish(*args: Any) -> Any:
        steps.append("payload")
        return finish(*args)

    store._start_local = spy_start  # type: ignore[method-assign]
    store._finish_local = spy_finish  # type: ignore[method-assign]
    read_all(store, CHUNKS)
    group = ["header"] * GROUP_MAX + ["payload"] * GROUP_MAX
    assert steps == group * (len(CHUNKS) // GROUP_MAX)
    store.close()


def test_group_size() -> None:
    two_mib, big = 2 * 2**20 + ALIGN, 32 * 2**20 + ALIGN
    assert _group_size(63, two_mib, 4) == GROUP_MAX  # small chunks share a group
    assert _group_size(8, two_mib, 4) == 2  # every thread still gets one
    assert _group_size(3, two_mib, 4) == 1
    assert _group_size(7, big, 4) == 1  # big chunks go alone
    assert _group_size(100, 0, 1) == GROUP_MAX
    assert _group_size(0, two_mib, 4) == 1


def test_an_interrupt_between_a_group_s_steps_leaves_no_file_open(tmp_path: Path) -> None:
    # A KeyboardInterrupt that lands at the entry of a read's second step (a signal is
    # raised at a function's entry) must not leave that read's file, or the group's later
    # ones, open. A trace function raises it there, deterministically.
    store = stocked(tmp_path, io_workers=1)
    entries = [0]

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        if event == "call" and frame.f_code is FsStore._finish_local.__code__:
            entries[0] += 1
            if entries[0] == 2:
                raise KeyboardInterrupt
        return None

    buffers = slots(GROUP_MAX, max(len(c.data) for c in CHUNKS))
    before = open_fds()
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            store.get_many_into([c.key for c in CHUNKS[:GROUP_MAX]], buffers)
    finally:
        sys.settrace(None)
    assert entries[0] >= 2
    assert open_fds() == before
    store.close()


def test_an_interrupt_while_waiting_for_helpers_is_raised_once_they_ended(
    tmp_path: Path,
) -> None:
    # SIGINT while the caller waits for the pool's threads: the call must not return (by
    # raising) while a helper still reads into the caller's buffers.
    store = stocked(tmp_path, io_workers=2, read_mode=BUFFERED)
    main = threading.main_thread()
    assert threading.current_thread() is main
    finish = store._finish_local
    helper_started, sent, helper_done = threading.Event(), threading.Event(), threading.Event()
    main_group_done = threading.Event()
    main_reads: list[object] = []

    def slow_on_helpers(read: Any) -> Any:
        if threading.current_thread() is main:
            assert helper_started.wait(30)  # the helper has taken the other group
            try:
                return finish(read)
            finally:
                main_reads.append(read)
                if len(main_reads) == GROUP_MAX:  # (8 chunks on 2 threads: groups of 4)
                    main_group_done.set()
        helper_started.set()
        # A slow disk: this read ends only after the interrupt was sent, so the call cannot
        # have returned before it, whatever the machine's load.
        assert sent.wait(30)
        time.sleep(0.05)
        try:
            return finish(read)
        finally:
            helper_done.set()

    store._finish_local = slow_on_helpers  # type: ignore[method-assign]

    def interrupt() -> None:
        # Once the caller has read its own group, it only waits for the helper.
        assert main_group_done.wait(30)
        signal.pthread_kill(main.ident, signal.SIGINT)  # type: ignore[arg-type]
        sent.set()

    buffers = slots(len(CHUNKS), max(len(c.data) for c in CHUNKS))
    before = open_fds()
    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        store.get_many_into([c.key for c in CHUNKS], buffers)
    assert helper_done.is_set()
    assert open_fds() == before
    store.close()


@pytest.mark.parametrize("workers", [1, 4])
def test_a_corrupt_chunk_asked_for_twice_in_one_batch_is_counted_once(
    tmp_path: Path, workers: int
) -> None:
    store = stocked(tmp_path, io_workers=workers)
    with open(store.path_of(CHUNKS[1].key), "wb") as f:
        f.write(corrupt_copies(CHUNKS[1])["bitflip"])
    picks = [0, 1, 1, 2, 0]  # one group of four holds both copies of the corrupt key
    chunks = [CHUNKS[i] for i in picks]
    buffers = slots(len(chunks), max(len(c.data) for c in chunks))
    sizes = store.get_many_into([c.key for c in chunks], buffers)
    assert sizes == [None if i == 1 else len(CHUNKS[i].data) for i in picks]
    for i, chunk, buffer in zip(picks, chunks, buffers):
        if i != 1:
            assert bytes(buffer[: len(chunk.data)]) == chunk.data
    assert store.corrupt_detected == 1 and len(store.quarantined()) == 1
    # get_many too: the file is gone now; a fresh damaged copy is found once per batch.
    with open(store.path_of(CHUNKS[3].key), "wb") as f:
        f.write(corrupt_copies(CHUNKS[3])["header"])
    got = store.get_many([CHUNKS[3].key, CHUNKS[0].key, CHUNKS[3].key, CHUNKS[0].key])
    assert got[0] is None and got[2] is None
    assert bytes(got[1] or b"") == bytes(got[3] or b"") == CHUNKS[0].data
    assert store.corrupt_detected == 2 and len(store.quarantined()) == 2
    store.close()


def test_a_duplicate_key_s_buffer_gets_the_chunk_or_its_own_error(tmp_path: Path) -> None:
    store = stocked(tmp_path, io_workers=1)
    size = len(CHUNKS[0].data)
    buffers = slots(3, size)
    buffers[2] = buffers[2][:10]  # too small for the chunk its key names
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_many_into([CHUNKS[0].key] * 3, buffers)
    assert bytes(buffers[0][:size]) == bytes(buffers[1][:size]) == CHUNKS[0].data
    store.close()
