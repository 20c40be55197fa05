"""FsStore's verified reads into a caller's buffer take the chunk's size from its header, with no
``fstat``: a damaged file is still judged exactly as a read that knows the file's size judges it
(same miss, same count, same quarantine reason), and a clean one costs no ``fstat`` at all."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import pytest

from chunkstore.backends import _layout as L
from chunkstore.backends._fastread import AUTO, BLOCK, BUFFERED
from chunkstore.backends._fs import FsStore
from chunkstore.errors import ConfigError
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import MadeChunk, sample_chunks, small_spec
from chunkstore.testing.store_suite import corrupt_copies

# several payload blocks, so the last block's read (with the byte past the end) is its own step
LAYOUT = ChunkLayout(small_spec(chunk_tokens=64, num_layers=2, num_kv_heads=8, head_dim=256))
CHUNK, OTHER = sample_chunks(2, seed=17, layout=LAYOUT)
assert len(CHUNK.data) > 2 * BLOCK


def damaged_files(chunk: MadeChunk, other: MadeChunk) -> dict[str, bytes]:
    data = chunk.data
    return {
        **corrupt_copies(chunk),
        "one byte short": data[:-1],
        "one block short": data[:-BLOCK],
        "one byte more": data + b"\0",
        "one block more": data + bytes(BLOCK),
        "another key's chunk": other.data,
    }


def slot(size: int) -> memoryview:
    """A page-aligned buffer like a host-cache slot."""
    return memoryview(mmap.mmap(-1, size))


def quarantine_reasons(store: FsStore) -> list[str]:
    """Why each quarantined chunk was set aside (the record without its time stamp)."""
    reasons = []
    for stored in store.quarantined():
        with open(stored.path + L.REASON_SUFFIX) as f:
            reasons.append(f.read().split(" ", 1)[1])
    return reasons


def outcome(store: FsStore, read: str) -> tuple[object, ...]:
    """What one read of CHUNK's damaged file gives and leaves behind."""
    room = len(CHUNK.data) + 2 * BLOCK
    if read == "get":  # into a new bytearray: sized by fstat (the reference)
        got: object = store.get(CHUNK.key)
    elif read == "get_into":
        got = store.get_into(CHUNK.key, slot(room))
    else:
        got = store.get_many_into([CHUNK.key, OTHER.key], [slot(room), slot(room)])
        assert got[1] == len(OTHER.data)  # type: ignore[index]
        got = got[0]  # type: ignore[index]
    return (
        got,
        store.corrupt_detected,
        store.read_errors,
        quarantine_reasons(store),
        os.path.exists(store.path_of(CHUNK.key)),
    )


@pytest.mark.parametrize("mode", [BUFFERED, AUTO])
@pytest.mark.parametrize("read", ["get_into", "get_many_into"])
@pytest.mark.parametrize("damage", sorted(damaged_files(CHUNK, OTHER)))
def test_a_damaged_file_is_judged_as_a_sized_read_judges_it(
    tmp_path: Path, mode: str, read: str, damage: str
) -> None:
    outcomes = {}
    for how in ("get", read):
        store = FsStore(str(tmp_path / how), create=True, read_mode=mode, io_workers=2)
        store.put_many([(CHUNK.key, CHUNK.data), (OTHER.key, OTHER.data)])
        with open(store.path_of(CHUNK.key), "wb") as f:
            f.write(damaged_files(CHUNK, OTHER)[damage])
        outcomes[how] = outcome(store, how)
        store.close()
    assert outcomes[read] == outcomes["get"]
    got, corrupt, errors, reasons, still_there = outcomes["get"]
    assert got is None and corrupt == 1 and errors == 0 and len(reasons) == 1 and not still_there


def test_a_clean_read_into_a_buffer_needs_no_fstat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FsStore(str(tmp_path), create=True)
    store.put_many([(CHUNK.key, CHUNK.data), (OTHER.key, OTHER.data)])
    buffers = [slot(len(CHUNK.data)), bytearray(len(OTHER.data))]
    assert store.get_many_into([CHUNK.key, OTHER.key], buffers) == [len(CHUNK.data)] * 2
    # (opened before counting: opening reads the layout marker, a regular file checked so)
    quiet = FsStore(str(tmp_path), track_access=False)
    stats: list[int] = []
    real = os.fstat

    def counted(fd: int) -> os.stat_result:
        stats.append(fd)
        return real(fd)

    monkeypatch.setattr(os, "fstat", counted)
    # the first reads settled the access records: these need no fstat at all
    assert store.get_into(CHUNK.key, buffers[0]) == len(CHUNK.data)
    assert store.get_many_into([CHUNK.key, OTHER.key], buffers) == [len(CHUNK.data)] * 2
    assert bytes(buffers[0][: len(CHUNK.data)]) == CHUNK.data and buffers[1] == OTHER.data
    assert stats == []
    # nor does any read of a store that does not track accesses
    assert quiet.get_into(OTHER.key, buffers[1]) == len(OTHER.data)
    assert stats == []


def test_access_is_still_recorded_once_per_resolution(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True, access_resolution=3600)
    store.put(CHUNK.key, CHUNK.data)
    path = store.path_of(CHUNK.key)
    old = time.time() - 10 * 3600
    os.utime(path, (old, old))
    buffer = slot(len(CHUNK.data))
    assert store.get_into(CHUNK.key, buffer) == len(CHUNK.data)
    first = os.stat(path)
    assert first.st_mtime == pytest.approx(old) and first.st_atime > old + 9 * 3600
    assert store.get_into(CHUNK.key, buffer) == len(CHUNK.data)
    assert os.stat(path).st_atime == first.st_atime  # within the resolution: no second write
    # a file whose own access time is recent is not written again either (and is remembered)
    fresh = FsStore(str(tmp_path), access_resolution=3600)
    os.utime(path, (time.time(), old))
    recent = os.stat(path).st_atime
    assert fresh.get_into(CHUNK.key, buffer) == len(CHUNK.data)
    assert fresh.get_into(CHUNK.key, buffer) == len(CHUNK.data)
    assert os.stat(path).st_atime == recent


def test_a_file_longer_than_the_buffer_is_judged_by_its_header(tmp_path: Path) -> None:
    """The header fits the buffer but the file does not: as with its size known from the
    start, the header judges it (bytes appended after the payload: a corrupt miss, set
    aside); only a whole chunk the buffer is too small for is the caller's error."""
    store = FsStore(str(tmp_path), create=True)
    store.put(CHUNK.key, CHUNK.data)
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_into(CHUNK.key, bytearray(len(CHUNK.data) - 1))
    with open(store.path_of(CHUNK.key), "ab") as f:
        f.write(b"\0")
    assert store.get_into(CHUNK.key, bytearray(len(CHUNK.data))) is None
    assert store.corrupt_detected == 1 and not store.exists(CHUNK.key)
