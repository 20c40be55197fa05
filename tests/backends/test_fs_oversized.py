"""A chunk file larger than the buffer it is read into (a host-cache slot): damaged ones
(bytes appended after the payload, a bad header) are corrupt misses, set aside like any
other, and the rest of a batch is served; only a whole chunk too big for the caller's buffer
is the caller's mistake (ConfigError)."""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Callable

import fsspec
import pytest

from chunkstore.backends._fastread import DIRECT, ChunkFileReader
from chunkstore.backends._fs import FsStore
from chunkstore.errors import ConfigError
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import sample_chunks, small_spec

CHUNKS = sample_chunks(4, seed=9)
SIZE = len(CHUNKS[0].data)


def _local(tmp_path) -> FsStore:
    return FsStore(str(tmp_path / "s"), create=True)


def _fsspec(tmp_path) -> FsStore:
    return FsStore(f"/oversized-{uuid.uuid4().hex}", fs=fsspec.filesystem("memory"), create=True)


def _damage(store: FsStore, index: int, how: str) -> None:
    path = store.path_of(CHUNKS[index].key)
    data = CHUNKS[index].data
    damaged = data + bytes(1 << 20) if how == "appended" else b"\x07" * (SIZE + 4096)
    store.io.write_small(path, damaged)  # replaced in place (local or fsspec)


@pytest.mark.parametrize("make", [_local, _fsspec], ids=["local", "fsspec"])
@pytest.mark.parametrize("how", ["appended", "garbage"])
def test_oversized_damaged_file_is_a_corrupt_miss_and_the_batch_is_served(
    tmp_path, make: Callable[..., FsStore], how: str
) -> None:
    store = make(tmp_path)
    for chunk in CHUNKS:
        store.put(chunk.key, chunk.data)
    _damage(store, 1, how)
    buffers = [bytearray(SIZE) for _ in CHUNKS]
    assert store.get_many_into([c.key for c in CHUNKS], buffers) == [SIZE, None, SIZE, SIZE]
    for i in (0, 2, 3):
        assert bytes(buffers[i]) == CHUNKS[i].data
    assert store.corrupt_detected == 1
    assert [q.path.rsplit("/", 1)[-1] for q in store.quarantined()] == [f"{CHUNKS[1].key.hex}.kvc"]
    assert store.get_into(CHUNKS[1].key, bytearray(SIZE)) is None  # gone from the serving path
    store.close()


@pytest.mark.parametrize("make", [_local, _fsspec], ids=["local", "fsspec"])
def test_whole_chunk_in_a_small_buffer_is_still_the_caller_s_mistake(
    tmp_path, make: Callable[..., FsStore]
) -> None:
    """The control: a valid chunk is never set aside because the buffer was small."""
    store = make(tmp_path)
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_into(CHUNKS[0].key, bytearray(SIZE - 1))
    assert store.corrupt_detected == 0 and store.quarantined() == []
    assert store.get(CHUNKS[0].key) == CHUNKS[0].data
    store.close()


def _foreign_header(how: str) -> bytes:
    """A whole, size-consistent chunk file larger than CHUNKS[1]'s whose header is not that
    chunk's: another key's (another model's, larger), or its own tokens not hashing to its key."""
    (other,) = sample_chunks(1, seed=5, layout=ChunkLayout(small_spec(num_layers=4)))
    data = bytearray(other.data)
    if how == "tokens do not hash to the key":
        at = bytes(data).index(b'"tokens":"') + len(b'"tokens":"')
        data[at] = ord("1") if data[at] == ord("0") else ord("0")
    return bytes(data)


@pytest.mark.parametrize("make", [_local, _fsspec], ids=["local", "fsspec"])
@pytest.mark.parametrize("how", ["another key's chunk", "tokens do not hash to the key"])
def test_oversized_chunk_whose_header_names_another_key_is_a_corrupt_miss(
    tmp_path, make: Callable[..., FsStore], how: str
) -> None:
    """Its header shows it is not the chunk asked for (spec 3.5: a corrupt chunk), as the
    store's read of the whole file says: not the caller's mistake, and the batch is served."""
    store = make(tmp_path)
    for chunk in CHUNKS:
        store.put(chunk.key, chunk.data)
    data = _foreign_header(how)
    assert len(data) > SIZE
    store.io.write_small(store.path_of(CHUNKS[1].key), data)
    buffers = [bytearray(SIZE) for _ in CHUNKS]
    assert store.get_many_into([c.key for c in CHUNKS], buffers) == [SIZE, None, SIZE, SIZE]
    assert store.corrupt_detected == 1
    assert [q.path.rsplit("/", 1)[-1] for q in store.quarantined()] == [f"{CHUNKS[1].key.hex}.kvc"]
    store.close()


def _around_the_page_cache(tmp_path) -> FsStore:
    """A store reading around the page cache (skips where the filesystem refuses O_DIRECT)."""
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(SIZE))
    fd = os.open(probe, os.O_RDONLY)
    try:
        if not ChunkFileReader(fd, _slot(SIZE), DIRECT).direct:
            pytest.skip("no O_DIRECT here")
    finally:
        os.close(fd)
    return FsStore(str(tmp_path / "s"), create=True, read_mode=DIRECT)


def _slot(size: int) -> memoryview:
    """A page-aligned buffer, as a host-cache slot is (so reads go around the page cache)."""
    return memoryview(mmap.mmap(-1, size))


def test_oversized_damaged_file_read_around_the_page_cache_is_a_corrupt_miss(tmp_path) -> None:
    """The header that judges the file is read through an fd the reader switched to
    O_DIRECT: the verdict is the one a buffered read gives (not a read error, left in place)."""
    store = _around_the_page_cache(tmp_path)
    for chunk in CHUNKS:
        store.put(chunk.key, chunk.data)
    _damage(store, 1, "appended")
    buffers = [_slot(SIZE) for _ in CHUNKS]
    assert store.get_many_into([c.key for c in CHUNKS], buffers) == [SIZE, None, SIZE, SIZE]
    assert (store.corrupt_detected, store.read_errors) == (1, 0)
    assert [q.path.rsplit("/", 1)[-1] for q in store.quarantined()] == [f"{CHUNKS[1].key.hex}.kvc"]
    with pytest.raises(ConfigError, match="smaller than the chunk"):  # the caller's mistake
        store.get_into(CHUNKS[0].key, _slot(SIZE - 4096))
    assert store.read_errors == 0
    store.close()
