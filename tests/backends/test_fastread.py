"""The fused read+verify path gives exactly decode_chunk's verdict on every input."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore import _hugepages
from chunkstore.backends import _fastread as fastread
from chunkstore.backends._fastread import (
    ALIGN,
    AUTO,
    BLOCK,
    BUFFERED,
    DIRECT,
    ChunkFileReader,
    Undecided,
    VerifiedRead,
    read_verified_into,
)
from chunkstore.errors import ChecksumMismatch, FormatError, TruncatedChunk
from chunkstore.format import ChunkLayout, decode_chunk, recompress
from chunkstore.testing.factories import sample_chunks, small_spec
from chunkstore.testing.store_suite import corrupt_copies

SMALL = sample_chunks(2, seed=8)
# several blocks of payload, so the block loop and its boundaries are exercised
BIG = sample_chunks(
    1,
    seed=9,
    layout=ChunkLayout(small_spec(chunk_tokens=64, num_layers=2, num_kv_heads=8, head_dim=256)),
)[0]
assert len(BIG.data) > 2 * BLOCK


def aligned_buffer(size: int) -> memoryview:
    """A page-aligned buffer like a host-cache slot (anonymous mmap)."""
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def verdicts(
    data: bytes, expected_key: bytes, mode: str = BUFFERED, room: int = 0
) -> tuple[str, str]:
    try:
        decode_chunk(data, expected_key=expected_key)
        reference = "ok"
    except FormatError:
        reference = "bad"
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        buffer = aligned_buffer(len(data) + room) if mode != BUFFERED else None
        target = memoryview(bytearray(len(data))) if buffer is None else buffer[: len(data)]
        reader = None if buffer is None else ChunkFileReader(f.fileno(), buffer, mode)
        try:
            read_verified_into(f.fileno(), target, expected_key, reader=reader)
            fused = "ok"
        except FormatError:
            fused = "bad"
        if fused == "ok":
            assert bytes(target) == data
    return reference, fused


@pytest.mark.parametrize("chunk", [SMALL[0], BIG], ids=["small", "big"])
def test_valid_and_damaged(chunk: object) -> None:
    chunk_data = chunk.data  # type: ignore[attr-defined]
    key = chunk.key.digest  # type: ignore[attr-defined]
    assert verdicts(chunk_data, key) == ("ok", "ok")
    for damaged in corrupt_copies(chunk).values():  # type: ignore[arg-type]
        assert verdicts(damaged, key) == ("bad", "bad")
    assert verdicts(SMALL[1].data, key) == ("bad", "bad")  # another chunk's bytes


def test_compressed_chunk() -> None:
    pytest.importorskip("zstandard")
    packed = recompress(BIG.data, "zstd")
    assert verdicts(packed, BIG.key.digest) == ("ok", "ok")
    assert verdicts(packed[:-3], BIG.key.digest) == ("bad", "bad")


@settings(max_examples=60, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=len(BIG.data) - 1),
    bit=st.integers(min_value=0, max_value=7),
    cut=st.one_of(st.none(), st.integers(min_value=0, max_value=len(BIG.data) - 1)),
)
def test_any_bit_flip_or_truncation(position: int, bit: int, cut: int | None) -> None:
    data = bytearray(BIG.data)
    data[position] ^= 1 << bit
    if cut is not None:
        data = data[:cut]
    reference, fused = verdicts(bytes(data), BIG.key.digest)
    assert fused == reference


@settings(max_examples=30, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=len(BIG.data) - 1),
    most=st.integers(min_value=1, max_value=BLOCK + 1),
)
def test_short_reads_give_the_same_verdicts(position: int, most: int) -> None:
    """The block loop's one-preadv fast path falls back to the reader on a short read."""
    real = os.preadv

    def short(fd: int, buffers: list, offset: int, *flags: int) -> int:
        return real(fd, [memoryview(buffers[0])[:most]], offset, *flags)

    data = bytearray(BIG.data)
    data[position] ^= 0x40
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fastread.os, "preadv", short)
        assert verdicts(BIG.data, BIG.key.digest) == ("ok", "ok")
        reference, fused = verdicts(bytes(data), BIG.key.digest)
    assert fused == reference == "bad"


# --- how bytes come in: page cache, O_DIRECT, or the page cache's own answer ---------------

# a payload that does not fill its last page: the file ends off an O_DIRECT boundary
UNALIGNED = sample_chunks(
    1,
    seed=11,
    layout=ChunkLayout(small_spec(chunk_tokens=64, num_layers=3, num_kv_heads=5, head_dim=100)),
)
assert len(UNALIGNED[0].data) % ALIGN and len(UNALIGNED[0].data) > BLOCK


@pytest.mark.parametrize("mode", [DIRECT, AUTO])
@pytest.mark.parametrize("room", [0, ALIGN], ids=["exact-buffer", "room-for-the-tail"])
def test_every_mode_gives_the_same_verdicts(mode: str, room: int) -> None:
    for chunk in (UNALIGNED[0], BIG):
        assert verdicts(chunk.data, chunk.key.digest, mode, room) == ("ok", "ok")
        for damaged in corrupt_copies(chunk).values():
            assert verdicts(damaged, chunk.key.digest, mode, room) == ("bad", "bad")


def write_cold(directory: str, data: bytes) -> int:
    """A file of ``data``, flushed and dropped from the page cache where the OS allows."""
    path = os.path.join(directory, "chunk")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return fd


@pytest.mark.parametrize("room", [0, ALIGN])
def test_direct_read_of_an_unaligned_tail(tmp_path: object, room: int) -> None:
    chunk = UNALIGNED[0]
    fd = write_cold(str(tmp_path), chunk.data)
    try:
        buffer = aligned_buffer(len(chunk.data) + room)
        reader = ChunkFileReader(fd, buffer, DIRECT)
        assert reader.direct
        read_verified_into(fd, buffer[: len(chunk.data)], chunk.key.digest, reader=reader)
        assert bytes(buffer[: len(chunk.data)]) == chunk.data
        assert reader.went_direct
        # without room past the end the tail came through the page cache
        assert reader.direct == (room > 0)
    finally:
        os.close(fd)


def test_auto_follows_the_page_cache(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    fd = write_cold(str(tmp_path), BIG.data)
    try:
        buffer = aligned_buffer(len(BIG.data))
        for cached in (True, False):
            monkeypatch.setattr(ChunkFileReader, "_cached", lambda self, c=cached: c)
            reader = ChunkFileReader(fd, buffer, AUTO)
            assert reader.direct is not cached and not reader.dropping
            read_verified_into(fd, buffer, BIG.key.digest, reader=reader)
            assert bytes(buffer) == BIG.data
            assert reader.went_direct is not cached
    finally:
        os.close(fd)


def test_auto_reads_a_large_cold_file_ahead_and_drops_it(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = write_cold(str(tmp_path), BIG.data)
    advised: list[tuple[int, int, int, int]] = []
    real_fadvise = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((fd, offset, length, advice))
        real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(fastread, "READAHEAD_FROM", len(BIG.data) - 1)  # BIG counts as large
    try:
        buffer = aligned_buffer(len(BIG.data))
        for cached in (True, False):
            monkeypatch.setattr(ChunkFileReader, "_cached", lambda self, c=cached: c)
            monkeypatch.setattr(os, "posix_fadvise", record)
            advised.clear()
            reader = ChunkFileReader(fd, buffer, AUTO)
            assert not reader.direct and reader.dropping is not cached
            read_verified_into(fd, buffer, BIG.key.digest, reader=reader)
            assert bytes(buffer) == BIG.data and not reader.went_direct
            reader.release()
            expected = [] if cached else [os.POSIX_FADV_SEQUENTIAL, os.POSIX_FADV_DONTNEED]
            assert [advice for *_, advice in advised] == expected
            assert all(call[:3] == (fd, 0, 0) for call in advised)  # the whole file
    finally:
        os.close(fd)


def test_auto_reads_a_large_cold_file_direct_into_memory_on_huge_pages(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = write_cold(str(tmp_path), BIG.data)
    monkeypatch.setattr(fastread, "READAHEAD_FROM", len(BIG.data) - 1)  # BIG counts as large
    monkeypatch.setattr(ChunkFileReader, "_cached", lambda self: False)
    buffer = aligned_buffer(len(BIG.data))
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    try:
        _hugepages.register(address, len(buffer))  # as a private pool's slots are
        reader = ChunkFileReader(fd, buffer, AUTO)
        assert reader.direct and not reader.dropping
        read_verified_into(fd, buffer, BIG.key.digest, reader=reader)
        assert bytes(buffer) == BIG.data and reader.went_direct
        _hugepages.unregister(address, len(buffer))  # now plain pages: read ahead
        reader = ChunkFileReader(fd, buffer, AUTO)
        assert not reader.direct and reader.dropping
        # Memory on huge pages that ends before the buffer does is not enough.
        _hugepages.register(address, len(buffer) - ALIGN)
        assert not ChunkFileReader(fd, buffer, AUTO).direct
    finally:
        _hugepages.unregister(address, len(buffer))
        os.close(fd)


def test_auto_probe_of_a_cached_file_reads_through_the_page_cache() -> None:
    with tempfile.TemporaryFile() as f:
        f.write(BIG.data)
        f.flush()
        buffer = aligned_buffer(len(BIG.data))
        reader = ChunkFileReader(f.fileno(), buffer, AUTO)  # just written: cached
        assert not reader.direct
        read_verified_into(f.fileno(), buffer, BIG.key.digest, reader=reader)
        assert not reader.went_direct


def test_unaligned_buffers_are_read_buffered() -> None:
    with tempfile.TemporaryFile() as f:
        f.write(BIG.data)
        f.flush()
        raw = bytearray(len(BIG.data) + 1)
        view = memoryview(raw)[1:]  # bytearray storage is not page-aligned at +1
        reader = ChunkFileReader(f.fileno(), view, DIRECT)
        assert not reader.direct
        read_verified_into(f.fileno(), view, BIG.key.digest, reader=reader)
        assert not reader.went_direct


def refuse_o_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """Act like a filesystem without O_DIRECT (some FUSE/network mounts): setting it fails."""
    real = fastread.fcntl.fcntl

    def fcntl(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fastread.fcntl.F_SETFL and arg & fastread.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real(fd, cmd, arg)

    monkeypatch.setattr(fastread.fcntl, "fcntl", fcntl)


def test_refused_o_direct_falls_back_to_the_page_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_o_direct(monkeypatch)
    with tempfile.TemporaryFile() as f:
        f.write(BIG.data)
        f.flush()
        buffer = aligned_buffer(len(BIG.data))
        reader = ChunkFileReader(f.fileno(), buffer, DIRECT)
        assert reader.refused and not reader.direct
        read_verified_into(f.fileno(), buffer, BIG.key.digest, reader=reader)
        assert bytes(buffer) == BIG.data


def test_o_direct_refused_at_read_time_finishes_buffered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = os.preadv

    def preadv(fd: int, buffers: list, offset: int, *flags: int) -> int:
        if fastread.fcntl.fcntl(fd, fastread.fcntl.F_GETFL) & fastread.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(fastread.os, "preadv", preadv)
    with tempfile.TemporaryFile() as f:
        f.write(BIG.data)
        f.flush()
        buffer = aligned_buffer(len(BIG.data))
        reader = ChunkFileReader(f.fileno(), buffer, DIRECT)
        read_verified_into(f.fileno(), buffer, BIG.key.digest, reader=reader)
        assert bytes(buffer) == BIG.data
        assert reader.refused and not reader.went_direct


def test_the_verdict_on_the_payload_comes_only_from_finish(tmp_path: object) -> None:
    flipped = bytearray(BIG.data)
    flipped[-1] ^= 0x10  # the last payload byte: the header step cannot see it
    path = os.path.join(str(tmp_path), "c")
    with open(path, "wb") as f:
        f.write(flipped)
    with open(path, "rb") as f:
        target = aligned_buffer(len(flipped))
        pending = VerifiedRead(f.fileno(), target, BIG.key.digest)
        with pytest.raises(ChecksumMismatch):
            pending.finish()


def test_a_damaged_header_fails_the_first_step(tmp_path: object) -> None:
    damaged = bytearray(BIG.data)
    damaged[20] ^= 0x01
    path = os.path.join(str(tmp_path), "c")
    with open(path, "wb") as f:
        f.write(damaged)
    with open(path, "rb") as f, pytest.raises(FormatError):
        VerifiedRead(f.fileno(), aligned_buffer(len(damaged)), BIG.key.digest)


def test_a_file_cut_short_between_the_steps_is_truncated(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "c")
    with open(path, "wb") as f:
        f.write(BIG.data)
    with open(path, "r+b") as f:
        pending = VerifiedRead(f.fileno(), aligned_buffer(len(BIG.data)), BIG.key.digest)
        os.ftruncate(f.fileno(), len(BIG.data) // 2)
        with pytest.raises(TruncatedChunk):
            pending.finish()


def test_the_auto_probe_s_page_is_not_read_again(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "c")
    with open(path, "wb") as f:
        f.write(BIG.data)
    with open(path, "rb") as f:  # just written: cached
        buffer = aligned_buffer(len(BIG.data))
        reader = ChunkFileReader(f.fileno(), buffer, AUTO)
        if not reader.probed:
            pytest.skip("no RWF_NOWAIT here")
        assert bytes(buffer[: reader.probed]) == BIG.data[: reader.probed]
        read_verified_into(f.fileno(), buffer, BIG.key.digest, reader=reader)
        assert bytes(buffer) == BIG.data


# --- a read sized by the chunk's header (no fstat): it vouches only for whole, valid chunks ---


def sized_by_header(data: bytes, expected_key: bytes, room: int) -> str:
    """``ok`` (the buffer then starts with exactly ``data``) or ``undecided``; a read sized by
    its header never gives a verdict of its own (no FormatError may come out)."""
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        buffer = memoryview(bytearray(b"\xee" * (len(data) + room)))
        try:
            pending = VerifiedRead(f.fileno(), buffer, expected_key, sized=False)
            pending.finish()
        except Undecided:
            return "undecided"
        assert bytes(pending.target) == data
        assert buffer[len(data) :] == b"\xee" * room  # nothing past the chunk written
        return "ok"


@pytest.mark.parametrize("room", [0, 1, ALIGN + 3])
def test_a_read_sized_by_the_header_reads_a_valid_chunk(room: int) -> None:
    for chunk in (SMALL[0], BIG, UNALIGNED[0]):
        assert sized_by_header(chunk.data, chunk.key.digest, room) == "ok"


def test_a_read_sized_by_the_header_vouches_for_no_damaged_file() -> None:
    data, key = BIG.data, BIG.key.digest
    longer = [data + b"\0", data + data[:ALIGN], data + bytes(BLOCK)]
    shorter = [data[:-1], data[: len(data) - BLOCK], data[:ALIGN], data[:100], b""]
    for damaged in [*longer, *shorter, *corrupt_copies(BIG).values(), SMALL[1].data]:
        for room in (0, 2 * BLOCK):
            assert sized_by_header(damaged, key, room) == "undecided"
    assert sized_by_header(data, key, -1) == "undecided"  # a buffer one byte short


@settings(max_examples=60, deadline=None)
@given(
    position=st.integers(min_value=0, max_value=len(BIG.data) - 1),
    bit=st.integers(min_value=0, max_value=7),
    cut=st.one_of(st.none(), st.integers(min_value=0, max_value=len(BIG.data) + 2)),
    room=st.sampled_from([0, 1, BLOCK]),
)
def test_a_read_sized_by_the_header_agrees_with_decode_chunk(
    position: int, bit: int, cut: int | None, room: int
) -> None:
    """Any bit flipped, the file cut or lengthened: ``ok`` exactly where decode_chunk says so."""
    data = bytearray(BIG.data)
    data[position] ^= 1 << bit
    if cut is not None:
        data = (data + data)[:cut]
    reference, _ = verdicts(bytes(data), BIG.key.digest)
    expected = "ok" if reference == "ok" else "undecided"
    assert sized_by_header(bytes(data), BIG.key.digest, room) == expected


@settings(max_examples=30, deadline=None)
@given(most=st.integers(min_value=1, max_value=BLOCK + 1))
def test_a_read_sized_by_the_header_survives_short_reads(most: int) -> None:
    """Short reads of the blocks go through the reader; one of the last block is undecided
    (never wrong either way)."""
    real = os.preadv

    def short(fd: int, buffers: list, offset: int, *flags: int) -> int:
        return real(fd, [memoryview(buffers[0])[:most]], offset, *flags)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fastread.os, "preadv", short)
        assert sized_by_header(BIG.data, BIG.key.digest, 0) in ("ok", "undecided")
        flipped = bytearray(BIG.data)
        flipped[len(flipped) // 2] ^= 0x04
        assert sized_by_header(bytes(flipped), BIG.key.digest, 0) == "undecided"


def test_a_read_around_the_page_cache_is_not_sized_by_the_header(tmp_path: object) -> None:
    fd = write_cold(str(tmp_path), BIG.data)
    try:
        buffer = aligned_buffer(len(BIG.data))
        reader = ChunkFileReader(fd, buffer, DIRECT)
        if not reader.direct:
            pytest.skip("no O_DIRECT here")
        with pytest.raises(Undecided):
            VerifiedRead(fd, buffer, BIG.key.digest, reader=reader, sized=False)
    finally:
        os.close(fd)


def test_a_compressed_chunk_is_not_sized_by_the_header() -> None:
    pytest.importorskip("zstandard")
    packed = recompress(BIG.data, "zstd")
    assert sized_by_header(packed, BIG.key.digest, 0) == "undecided"
