"""A stored chunk larger than the caller's buffer, read with ``verify=False``: every store
gives the same answer. Damaged bytes (appended after the payload, a garbage file) are a miss
of that key in ``get_into`` and ``get_many_into``, counted and set aside as with
verification, and the rest of a batch is served; only a whole chunk too large for the
buffer is the caller's mistake (ConfigError)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.errors import ConfigError
from chunkstore.testing.factories import sample_chunks

CHUNKS = sample_chunks(3, seed=61)
SIZE = len(CHUNKS[0].data)
DAMAGED = {
    "appended": CHUNKS[1].data + bytes(1 << 20),
    "garbage": b"\x07" * (SIZE + 4096),
}


@pytest.fixture(params=["local", "fsspec", "s3"])
def make_unverified(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """A factory of ``verify=False`` stores over one location, for each kind of store."""
    made: list[Any] = []
    fs = fsspec.filesystem("memory")
    root = f"/unverified-{uuid.uuid4().hex}"

    def make() -> Any:
        if request.param == "local":
            store: Any = FsStore(str(tmp_path / "s"), create=True, verify=False)
        elif request.param == "fsspec":
            store = FsStore(root, fs=fs, create=True, verify=False)
        else:
            pytest.importorskip("s3fs")
            from chunkstore.backends._s3 import S3Store

            endpoint = request.getfixturevalue("s3_endpoint")
            bucket = request.getfixturevalue("s3_bucket")
            store = S3Store(bucket, "p", endpoint_url=endpoint, backoff=0.001, verify=False)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.mark.parametrize("how", sorted(DAMAGED))
def test_damaged_and_larger_than_the_buffer_is_a_miss(
    make_unverified: Callable[[], Any], how: str
) -> None:
    store = make_unverified()
    store.put_many([(c.key, c.data) for c in CHUNKS])
    store.put(CHUNKS[1].key, DAMAGED[how])
    buffers = [bytearray(SIZE) for _ in CHUNKS]
    assert store.get_many_into([c.key for c in CHUNKS], buffers) == [SIZE, None, SIZE]
    for i in (0, 2):
        assert bytes(buffers[i]) == CHUNKS[i].data
    assert store.corrupt_detected == 1
    assert store.exists(CHUNKS[1].key) is False  # set aside, as a verified read does
    assert store.get_into(CHUNKS[1].key, bytearray(SIZE)) is None


def test_damaged_and_larger_than_the_buffer_is_a_miss_in_get_into(
    make_unverified: Callable[[], Any],
) -> None:
    store = make_unverified()
    store.put(CHUNKS[1].key, DAMAGED["appended"])
    assert store.get_into(CHUNKS[1].key, bytearray(SIZE)) is None
    assert store.corrupt_detected == 1


def test_whole_chunk_in_a_small_buffer_is_the_caller_s_mistake(
    make_unverified: Callable[[], Any],
) -> None:
    """The control: a whole chunk is never set aside because the buffer was small."""
    store = make_unverified()
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_into(CHUNKS[0].key, bytearray(SIZE - 1))
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_many_into([CHUNKS[0].key], [bytearray(SIZE - 1)])
    assert store.corrupt_detected == 0 and store.quarantined() == []
    assert bytes(store.get(CHUNKS[0].key) or b"") == CHUNKS[0].data
