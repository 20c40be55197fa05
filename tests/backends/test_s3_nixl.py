"""S3Store with ``data_path="nixl"`` (NIXL's OBJ backend) on a local moto server.

It passes the store conformance suite, writes exactly the objects the s3fs data
path writes (and reads what that one wrote), really moves chunk bytes through
NIXL (the s3fs client sends no GET/PUT for them), and fails at open with one
clear error when NIXL cannot do the job.
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from chunkstore.errors import ConfigError, MissingDependency, StoreError
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import MadeChunk, sample_chunks, small_spec
from chunkstore.testing.store_suite import StoreSuite

pytest.importorskip("s3fs")
pytest.importorskip("nixl._api", reason="data_path='nixl' needs NIXL")

from chunkstore.backends._s3 import S3Store  # noqa: E402


def _nixl_store(endpoint: str, bucket: str, **options: Any) -> S3Store:
    options.setdefault("access_resolution", 0)
    options.setdefault("backoff", 0.001)
    return S3Store(bucket, "kv/cache", endpoint_url=endpoint, data_path="nixl", **options)


class TestS3NixlStore(StoreSuite):
    time_resolution = 1.05  # S3 LastModified has one-second resolution

    @pytest.fixture
    def make_store(self, s3_endpoint: str, s3_bucket: str) -> Callable[[], S3Store]:
        return lambda: _nixl_store(s3_endpoint, s3_bucket)


# --- same objects either way --------------------------------------------------------------


@pytest.fixture
def both(s3_endpoint: str, s3_bucket: str) -> Iterator[tuple[S3Store, S3Store]]:
    """(a NIXL-path store, an s3fs-path store) over the same bucket and prefix."""
    nixl = _nixl_store(s3_endpoint, s3_bucket)
    plain = S3Store(s3_bucket, "kv/cache", endpoint_url=s3_endpoint, backoff=0.001)
    yield nixl, plain
    nixl.close()
    plain.close()


@pytest.fixture
def chunks() -> list[MadeChunk]:
    return sample_chunks(4, seed=5)


def _objects(endpoint: str, bucket: str) -> dict[str, bytes]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return {n: client.get_object(Bucket=bucket, Key=n)["Body"].read() for n in names}


def test_nixl_writes_what_s3fs_writes(
    s3_endpoint: str, s3_bucket: str, both: tuple[S3Store, S3Store], chunks: list[MadeChunk]
) -> None:
    nixl, plain = both
    assert nixl.put_many([(c.key, c.data) for c in chunks[:2]]) == [True, True]
    assert plain.put_many([(c.key, c.data) for c in chunks[2:]]) == [True, True]
    stored = _objects(s3_endpoint, s3_bucket)
    for chunk in chunks:  # one naming rule, byte-identical bodies, whichever path wrote
        assert stored[f"kv/cache/{chunk.key.path}"] == chunk.data
    for reader in (nixl, plain):
        got = reader.get_many([c.key for c in chunks])
        assert [bytes(g) if g is not None else None for g in got] == [c.data for c in chunks]


def test_nixl_reads_into_the_callers_buffer(
    both: tuple[S3Store, S3Store], chunks: list[MadeChunk]
) -> None:
    nixl, plain = both
    chunk = chunks[0]
    plain.put(chunk.key, chunk.data)
    buffer = np.full(len(chunk.data) + 100, 0xAB, dtype=np.uint8)
    assert nixl.get_into(chunk.key, buffer) == len(chunk.data)
    assert buffer[: len(chunk.data)].tobytes() == chunk.data
    assert (buffer[len(chunk.data) :] == 0xAB).all()  # nothing past the object is touched
    with pytest.raises(ConfigError):
        nixl.get_into(chunk.key, bytearray(len(chunk.data) - 1))


def test_nixl_ranged_reads_match_s3fs(
    both: tuple[S3Store, S3Store], chunks: list[MadeChunk]
) -> None:
    nixl, plain = both
    chunk = chunks[0]
    nixl.put(chunk.key, chunk.data)
    ranges = ChunkLayout(small_spec()).rank_ranges(1, 2)
    assert nixl.read_ranges(chunk.key, ranges) == plain.read_ranges(chunk.key, ranges)
    beyond = [type(ranges[0])(len(chunk.data) - 10, 20)]  # NIXL's GET would come back short
    assert nixl.read_ranges(chunk.key, beyond) is None


def test_chunk_bytes_bypass_the_s3fs_client(
    both: tuple[S3Store, S3Store], chunks: list[MadeChunk], monkeypatch: pytest.MonkeyPatch
) -> None:
    nixl, _ = both
    nixl.track_access = False
    nixl.put(chunks[0].key, chunks[0].data)  # the layout marker goes out before counting
    sent: list[tuple[str, str]] = []
    request = nixl._request

    async def counting(op: str, **kwargs: Any) -> Any:
        sent.append((op, kwargs.get("Key", "")))
        return await request(op, **kwargs)

    monkeypatch.setattr(nixl, "_request", counting)
    assert nixl.put_many([(c.key, c.data) for c in chunks]) == [True] * len(chunks)
    assert [bytes(g or b"") for g in nixl.get_many([c.key for c in chunks])] == [
        c.data for c in chunks
    ]
    # s3fs only asked for sizes (NIXL's GET needs the length); bodies went through NIXL
    assert {op for op, _ in sent} == {"head_object"}
    assert len(sent) == len(chunks)


def test_crt_client_uploads_large_objects_in_parts(
    s3_endpoint: str, s3_bucket: str, both: tuple[S3Store, S3Store]
) -> None:
    import boto3

    _, plain = both
    big = _nixl_store(s3_endpoint, s3_bucket, nixl_params={"crtMinLimit": str(5 << 20)})
    try:
        key = sample_chunks(1, seed=9)[0].key
        body = np.random.default_rng(0).bytes(6 << 20)  # stored unchecked: bytes are bytes
        assert big.put(key, body)
        head = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").head_object(
            Bucket=s3_bucket, Key=big.object_key(key)
        )
        assert re.fullmatch(r"[0-9a-f]{32}-\d+", head["ETag"].strip('"'))  # multipart
        assert plain.read_unchecked_many([key]) == [body]
        assert big.read_unchecked_many([key]) == [body]
    finally:
        big.close()


# --- put_if_absent -----------------------------------------------------------------------


def test_conditional_put_stays_on_s3fs(
    both: tuple[S3Store, S3Store], chunks: list[MadeChunk], monkeypatch: pytest.MonkeyPatch
) -> None:
    nixl, plain = both
    a, b = chunks[:2]
    nixl.put(a.key, a.data)
    writes: list[Any] = []
    monkeypatch.setattr(
        nixl._plane, "write_many", lambda items: writes.append(items) or [False] * len(items)
    )
    assert nixl.put_if_absent_many([(a.key, a.data), (b.key, b.data)]) == [False, True]
    assert writes == []  # If-None-Match PUTs: NIXL's OBJ PUT cannot carry the condition
    assert bytes(plain.get(b.key) or b"") == b.data


def test_unconditional_servers_head_then_nixl_put(
    s3_endpoint: str, s3_bucket: str, chunks: list[MadeChunk]
) -> None:
    store = _nixl_store(s3_endpoint, s3_bucket, conditional_writes=False)
    try:
        a, b = chunks[:2]
        assert store.put_if_absent(a.key, a.data) is True
        assert store.put_if_absent_many([(a.key, b.data), (b.key, b.data)]) == [False, True]
        assert bytes(store.get(a.key) or b"") == a.data
    finally:
        store.close()


# --- failures are misses -------------------------------------------------------------------


def test_rewritten_between_head_and_get_is_not_quarantined(
    both: tuple[S3Store, S3Store], chunks: list[MadeChunk], monkeypatch: pytest.MonkeyPatch
) -> None:
    nixl, _ = both
    chunk = chunks[0]
    nixl.put(chunk.key, chunk.data)
    # the HEAD saw an older, shorter version: NIXL fetches a prefix that fails the checksum
    monkeypatch.setattr(nixl._plane, "_sizes", lambda names: [len(chunk.data) - 7] * len(names))
    assert bytes(nixl.get(chunk.key) or b"") == chunk.data
    buffer = bytearray(len(chunk.data))
    assert nixl.get_into(chunk.key, buffer) == len(chunk.data) and bytes(buffer) == chunk.data
    assert nixl.corrupt_detected == 0
    assert nixl.exists(chunk.key)


def test_failed_transfer_is_a_miss(
    both: tuple[S3Store, S3Store], chunks: list[MadeChunk], monkeypatch: pytest.MonkeyPatch
) -> None:
    nixl, _ = both
    chunk = chunks[0]
    # deleted between HEAD and GET: NIXL's GET fails
    monkeypatch.setattr(nixl._plane, "_sizes", lambda names: [100] * len(names))
    assert nixl.get_many([chunk.key, chunk.key]) == [None, None]  # (one read per key)
    assert nixl.get_into(chunk.key, bytearray(200)) is None
    assert nixl._plane.failed_transfers == 2
    assert nixl.corrupt_detected == 0


# --- opening ---------------------------------------------------------------------------------


def test_option_validation(s3_endpoint: str, s3_bucket: str) -> None:
    with pytest.raises(ConfigError, match="data_path"):
        S3Store(s3_bucket, endpoint_url=s3_endpoint, data_path="ucx")
    with pytest.raises(ConfigError, match="nixl_params"):
        S3Store(s3_bucket, endpoint_url=s3_endpoint, nixl_params={"req_checksum": "required"})
    with pytest.raises(ConfigError, match="anon"):
        S3Store(s3_bucket, endpoint_url=s3_endpoint, data_path="nixl", anon=True)


def test_rejected_backend_parameters_fail_at_open(s3_endpoint: str, s3_bucket: str) -> None:
    with pytest.raises(StoreError, match="rejected its parameters"):
        _nixl_store(s3_endpoint, s3_bucket, nixl_params={"scheme": "ftp"})


def test_endpoint_nixl_cannot_reach_fails_at_open(s3_endpoint: str, s3_bucket: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(StoreError, match="cannot use bucket .* although s3fs can"):
        _nixl_store(
            s3_endpoint, s3_bucket, max_attempts=1, nixl_params={"endpoint_override": closed}
        )


def test_missing_nixl_is_an_install_hint(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(MissingDependency, match=r"chunkstore\[nixl\]"):
        _nixl_store(s3_endpoint, s3_bucket)


def test_oversized_damaged_object_is_a_corrupt_miss_not_a_config_error(
    s3_endpoint: str, s3_bucket: str, chunks: list[MadeChunk]
) -> None:
    """An object with bytes appended after its payload is larger than the slot it is read
    into: like the s3fs path, a corrupt miss set aside (and the rest of the batch served);
    only a whole chunk too big for the buffer is the caller's ConfigError."""
    import boto3

    store = _nixl_store(s3_endpoint, s3_bucket)
    for chunk in chunks:
        store.put(chunk.key, chunk.data)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    damaged = store.object_key(chunks[1].key)
    client.put_object(Bucket=s3_bucket, Key=damaged, Body=chunks[1].data + bytes(1 << 16))
    size = len(chunks[0].data)
    buffers = [bytearray(size) for _ in chunks]
    assert store.get_many_into([c.key for c in chunks], buffers) == [size, None, size, size]
    assert [bytes(b) for i, b in enumerate(buffers) if i != 1] == [
        c.data for i, c in enumerate(chunks) if i != 1
    ]
    assert store.corrupt_detected == 1 and len(store.quarantined()) == 1
    with pytest.raises(ConfigError, match="smaller than the chunk"):
        store.get_into(chunks[0].key, bytearray(size - 1))
    store.close()
