"""S3Store specifics on moto: open errors, request counts, faults, multipart, ranges."""

from __future__ import annotations

import asyncio
import math
import random
import threading
from typing import Any

import pytest

pytest.importorskip("s3fs")

from botocore.exceptions import ClientError, ReadTimeoutError  # noqa: E402

from chunkstore.backends._registry import open_store  # noqa: E402
from chunkstore.backends._s3 import S3Store, open_s3_store  # noqa: E402
from chunkstore.errors import ConfigError, StoreError  # noqa: E402
from chunkstore.format import ChunkLayout, decode_chunk  # noqa: E402
from chunkstore.testing.factories import sample_chunks, small_spec  # noqa: E402
from chunkstore.testing.stateful import store_state_machine  # noqa: E402
from chunkstore.testing.store_suite import corrupt_copies  # noqa: E402
from tests.services import free_port  # noqa: E402


class ClientProxy:
    """Wraps the aiobotocore client: counts calls per operation and injects faults."""

    def __init__(
        self, client: Any, *, fail_share: float = 0.0, seed: int = 0, ops: tuple[str, ...] = ()
    ) -> None:
        self._client = client
        self.calls: dict[str, int] = {}
        self.fail_share = fail_share
        self.faults = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._ops = ops

    def __getattr__(self, op: str) -> Any:
        target = getattr(self._client, op)
        if not callable(target) or op.startswith("_") or op in ("close", "meta"):
            return target

        async def call(**kwargs: Any) -> Any:
            with self._lock:
                self.calls[op] = self.calls.get(op, 0) + 1
                roll = self._rng.random()
                kind = self._rng.choice(["503", "slowdown", "timeout", "reset", "hang"])
            if (not self._ops or op in self._ops) and roll < self.fail_share:
                self.faults += 1
                if kind == "503":
                    raise ClientError(
                        {
                            "Error": {"Code": "ServiceUnavailable"},
                            "ResponseMetadata": {"HTTPStatusCode": 503},
                        },
                        op,
                    )
                if kind == "slowdown":
                    raise ClientError(
                        {
                            "Error": {"Code": "SlowDown"},
                            "ResponseMetadata": {"HTTPStatusCode": 503},
                        },
                        op,
                    )
                if kind == "timeout":
                    raise ReadTimeoutError(endpoint_url="http://moto")
                if kind == "reset":
                    raise ConnectionResetError("connection reset by peer")
                await asyncio.sleep(10)  # a hung request: the store's timeout must cut it
            return await target(**kwargs)

        return call


def make(endpoint: str, bucket: str, **options: Any) -> S3Store:
    options.setdefault("backoff", 0.001)
    return S3Store(bucket, "p", endpoint_url=endpoint, **options)


def test_open_missing_bucket(s3_endpoint: str) -> None:
    with pytest.raises(StoreError, match="bucket 'no-such-bucket' does not exist"):
        S3Store("no-such-bucket", endpoint_url=s3_endpoint)


def test_open_unreachable_endpoint() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StoreError, match="cannot reach the S3 endpoint"):
        S3Store("bucket", endpoint_url=endpoint, backoff=0.001, timeout=2)


def test_open_bad_credentials(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # moto accepts any key; emulate AWS's answer to an unknown access key
    async def denied(self: Any, prefix: str) -> Any:
        raise ClientError(
            {"Error": {"Code": "InvalidAccessKeyId"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
            "ListObjectsV2",
        )

    monkeypatch.setattr(S3Store, "_open_probe", denied)
    with pytest.raises(StoreError, match="access denied.*credentials"):
        S3Store(s3_bucket, endpoint_url=s3_endpoint, key="wrong", secret="wrong")


def test_open_refuses_foreign_prefix(s3_endpoint: str, s3_bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket=s3_bucket, Key="data/report.csv", Body=b"a,b"
    )
    with pytest.raises(StoreError, match="not a chunkstore prefix"):
        S3Store(s3_bucket, "data", endpoint_url=s3_endpoint)


def test_registry_and_options(s3_endpoint: str, s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/a/b", endpoint_url=s3_endpoint)
    assert isinstance(store, S3Store) and store.prefix == "a/b"
    chunk = sample_chunks(1)[0]
    store.put(chunk.key, chunk.data)
    import boto3

    names = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=s3_bucket)[
            "Contents"
        ]
    ]
    assert sorted(names) == sorted([f"a/b/{chunk.key.path}", "a/b/chunkstore-layout.json"])
    with pytest.raises(ConfigError, match="invalid option"):
        open_s3_store(f"s3://{s3_bucket}", colour="blue")
    with pytest.raises(ConfigError, match="needs a bucket"):
        open_s3_store("s3://")


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 33])
def test_lookup_prefix_request_count(s3_endpoint: str, s3_bucket: str, n: int) -> None:
    chunks = sample_chunks(n, seed=n)
    keys = [c.key for c in chunks]
    store = make(s3_endpoint, s3_bucket)
    bound = math.ceil(math.log2(n)) + 2
    stored = 0
    for present in sorted({0, 1, n // 2, n - 1, n} | (set(range(n + 1)) if n <= 8 else set())):
        store.put_many([(c.key, c.data) for c in chunks[stored:present]])
        stored = present
        proxy = ClientProxy(store._client)
        store._client = proxy
        try:
            assert store.lookup_prefix(keys) == present
        finally:
            store._client = proxy._client
        assert sum(proxy.calls.values()) <= bound, (present, proxy.calls)
    store.close()


def test_faults_give_correct_data_or_a_miss(s3_endpoint: str, s3_bucket: str) -> None:
    chunks = sample_chunks(12, seed=4)
    clean = make(s3_endpoint, s3_bucket)
    clean.put_many([(c.key, c.data) for c in chunks[:8]])
    by_key = {c.key: c.data for c in chunks}
    store = make(s3_endpoint, s3_bucket, max_attempts=3, timeout=0.25, track_access=False)
    proxy = ClientProxy(store._client, fail_share=0.4, seed=7)
    store._client = proxy
    hits = 0
    stored = {c.key for c in chunks[:8]}
    for round_ in range(6):
        got = store.get_many([c.key for c in chunks])
        for c, data in zip(chunks, got):
            if data is not None:
                assert bytes(data) == by_key[c.key]
                decode_chunk(data, expected_key=c.key.digest)
                hits += 1
        attempted = {c.key for c in chunks[8:]} if round_ else set()
        for c, present in zip(chunks, store.exists_many([c.key for c in chunks])):
            # a fault may hide a chunk, never invent one; but a put whose every attempt timed
            # out (a busy machine) may still have landed without being reported as written
            assert present is False or c.key in stored | attempted
        ranges = ChunkLayout(small_spec()).rank_ranges(0, 2)
        parts = store.read_ranges(chunks[round_].key, ranges)
        if parts is not None:
            assert parts == [
                by_key[chunks[round_].key][r.offset : r.offset + r.length] for r in ranges
            ]
        written = store.put_if_absent_many([(c.key, c.data) for c in chunks[8:]])
        for c, ok in zip(chunks[8:], written):
            assert isinstance(ok, bool) and not (ok and c.key in stored)
            if ok:
                stored.add(c.key)
    assert proxy.faults > 20
    assert hits > 0 and store.corrupt_detected == 0
    store._client = proxy._client
    # whatever the faulty writes did, every chunk stored is whole
    for c, data in zip(chunks, clean.get_many([c.key for c in chunks])):
        assert data is None or bytes(data) == by_key[c.key]
    assert clean.corrupt_detected == 0
    store.close()
    clean.close()


def test_exhausted_retries_are_misses_and_counted(s3_endpoint: str, s3_bucket: str) -> None:
    chunk = sample_chunks(1)[0]
    store = make(s3_endpoint, s3_bucket, max_attempts=2)
    store.put(chunk.key, chunk.data)
    proxy = ClientProxy(store._client, fail_share=1.0, ops=("get_object", "put_object"))
    store._client = proxy
    proxy._rng = random.Random(1)
    assert store.get(chunk.key) is None
    assert store.put(sample_chunks(2)[1].key, sample_chunks(2)[1].data) is False
    assert store.failed_requests == 2
    store._client = proxy._client
    assert store.get(chunk.key) == chunk.data
    store.close()


def test_multipart_and_conditional_multipart(s3_endpoint: str, s3_bucket: str) -> None:
    layout = ChunkLayout(small_spec(chunk_tokens=256, num_layers=8, num_kv_heads=8, head_dim=128))
    big = sample_chunks(2, layout=layout)
    assert len(big[0].data) > 6 << 20
    store = make(s3_endpoint, s3_bucket, multipart_threshold=5 << 20, part_size=5 << 20)
    proxy = ClientProxy(store._client)
    store._client = proxy
    assert store.put_if_absent(big[0].key, big[0].data) is True
    assert proxy.calls.get("upload_part", 0) >= 2 and "complete_multipart_upload" in proxy.calls
    assert store.put_if_absent(big[0].key, big[0].data) is False
    assert store.put(big[1].key, big[1].data) is True
    assert store.get(big[0].key) == big[0].data and store.get(big[1].key) == big[1].data
    assert store.orphans() == []
    store.close()


class LostFirstAnswer:
    """Wraps the client: the first call of ``op`` on a chunk times out, after reaching S3 (its
    answer is lost: the store retries a request that already took effect) or, with
    ``reach=False``, before."""

    def __init__(self, client: Any, op: str) -> None:
        self._client, self._op = client, op
        self.lost = 0
        self.reach = True

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._client, name)
        if name != self._op:
            return target

        async def call(**kwargs: Any) -> Any:
            if self.lost == 0 and kwargs["Key"].endswith(".kvc"):
                self.lost += 1
                if self.reach:
                    await target(**kwargs)
                raise ReadTimeoutError(endpoint_url="http://moto")
            return await target(**kwargs)

        return call


@pytest.mark.parametrize("size", ["single", "multipart"])
def test_put_if_absent_retried_after_a_lost_answer_says_written(
    s3_endpoint: str, s3_bucket: str, size: str
) -> None:
    """Review #14: the retry of a conditional PUT that already landed gets 412; the store
    must still say this call wrote it, and say False when another writer did."""
    if size == "single":
        chunks = sample_chunks(2, seed=9)
        store, op = make(s3_endpoint, s3_bucket), "put_object"
    else:
        layout = ChunkLayout(
            small_spec(chunk_tokens=256, num_layers=8, num_kv_heads=8, head_dim=128)
        )
        chunks = sample_chunks(2, layout=layout)
        store = make(s3_endpoint, s3_bucket, multipart_threshold=5 << 20, part_size=5 << 20)
        op = "complete_multipart_upload"
    other = make(s3_endpoint, s3_bucket)
    proxy = LostFirstAnswer(store._client, op)
    store._client = proxy
    mine, theirs = chunks
    assert store.put_if_absent(mine.key, mine.data) is True
    assert proxy.lost == 1
    assert other.put_if_absent(theirs.key, theirs.data) is True
    proxy.lost, proxy.reach = 0, False  # a retry again, but the 412 is the other writer's
    assert store.put_if_absent(theirs.key, theirs.data) is False
    assert proxy.lost == 1
    assert store.put_if_absent(mine.key, mine.data) is False
    assert other.get(mine.key) == mine.data and other.get(theirs.key) == theirs.data
    store.close()
    other.close()


def test_set_aside_retried_after_a_lost_answer_says_done(s3_endpoint: str, s3_bucket: str) -> None:
    """The retry of a conditional DELETE that already landed gets 404: the chunk was set
    aside, and the set-aside finishes (its reason written, its access record removed)."""
    import boto3

    chunk = sample_chunks(1, seed=83)[0]
    store = make(s3_endpoint, s3_bucket)
    store.put(chunk.key, corrupt_copies(chunk)["bitflip"])
    name = store.object_key(chunk.key)
    admin = boto3.client("s3", endpoint_url=s3_endpoint)
    admin.put_object(Bucket=s3_bucket, Key=name + ".atime", Body=b"1764000000")
    [(_, ident)] = store.read_unchecked_with_idents([chunk.key])
    proxy = LostFirstAnswer(store._client, "delete_object")
    store._client = proxy
    assert store.quarantine_if_unchanged(chunk.key, ident, "ChecksumMismatch: bad") is True
    assert proxy.lost == 1
    assert store.exists(chunk.key) is False
    names = [o["Key"] for o in admin.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    aside = f"p/quarantine/{chunk.key.namespace}/{chunk.key.hex}.kvc"
    assert aside in names and aside + ".reason" in names and name + ".atime" not in names
    store.close()


def test_without_conditional_writes(s3_endpoint: str, s3_bucket: str) -> None:
    chunk = sample_chunks(1)[0]
    store = make(s3_endpoint, s3_bucket, conditional_writes=False)
    assert store.put_if_absent(chunk.key, chunk.data) is True
    assert store.put_if_absent(chunk.key, chunk.data) is False
    store.close()


def test_orphan_multipart_uploads(s3_endpoint: str, s3_bucket: str) -> None:
    import boto3

    store = make(s3_endpoint, s3_bucket)
    chunk = sample_chunks(1)[0]
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_multipart_upload(Bucket=s3_bucket, Key=f"p/{chunk.key.path}")
    assert len(store.orphans()) == 1
    assert store.remove_orphans(grace=0) == 1
    assert store.orphans() == []
    store.close()


def test_quarantine_and_foreign(s3_endpoint: str, s3_bucket: str) -> None:
    import boto3

    chunks = sample_chunks(2)
    store = make(s3_endpoint, s3_bucket)
    store.put(chunks[0].key, chunks[0].data[:-10])
    assert store.get(chunks[0].key) is None
    assert [q.path for q in store.quarantined()] == [
        f"p/quarantine/{chunks[0].key.namespace}/{chunks[0].key.hex}.kvc"
    ]
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(
        Bucket=s3_bucket, Key=f"p/{chunks[1].key.namespace}/junk.txt", Body=b"x"
    )
    assert [f.path for f in store.foreign_files()] == [f"p/{chunks[1].key.namespace}/junk.txt"]
    store.close()


@pytest.mark.parametrize("verify", [True, False])
def test_a_corrupt_chunk_asked_for_twice_in_one_batch_is_counted_once(
    s3_endpoint: str, s3_bucket: str, verify: bool
) -> None:
    """As a loop of single reads would: the first finds it (counted, set aside), the
    second misses. Without verify, a damaged object larger than the buffer is judged by
    its header (:func:`~chunkstore.backends.base.judge_oversized`), also once."""
    good, bad = sample_chunks(2, seed=79)
    store = make(s3_endpoint, s3_bucket, verify=verify)
    store.put(good.key, good.data)
    # (without verify: bytes appended, larger than the buffer)
    store.put(bad.key, corrupt_copies(bad)["bitflip"] if verify else bad.data + b"x" * 64)
    keys = [bad.key, good.key, bad.key]
    if verify:
        got = store.get_many(keys)
        assert [g is None for g in got] == [True, False, True]
    else:
        buffers = [bytearray(len(bad.data)) for _ in keys]
        assert store.get_many_into(keys, buffers) == [None, len(good.data), None]
    assert store.corrupt_detected == 1
    assert len(store.quarantined()) == 1
    store.close()


TestS3StoreMachine = None  # replaced below when moto is importable


def _machine() -> Any:
    import uuid

    import boto3
    from moto.server import ThreadedMotoServer

    state: dict[str, Any] = {}

    def factory() -> S3Store:
        if "endpoint" not in state:
            port = free_port()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            state["endpoint"] = f"http://127.0.0.1:{port}"
        bucket = f"sm-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=state["endpoint"],
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=bucket)
        return S3Store(
            bucket,
            "sm",
            endpoint_url=state["endpoint"],
            key="testing",
            secret="testing",
            backoff=0.001,
            track_access=False,
        )

    return store_state_machine(factory, max_examples=10, steps=15).TestCase


TestS3StoreMachine = _machine()


@pytest.mark.parametrize("prefix", ["", "p"], ids=["bucket-root", "prefix"])
def test_orphan_sweep_leaves_other_applications_uploads_alone(
    s3_endpoint: str, s3_bucket: str, prefix: str
) -> None:
    """Only a chunk's unfinished upload is chunkstore's: another application's multipart
    upload in the same bucket (or under the prefix, beside the namespaces) is never aborted."""
    import boto3

    store = S3Store(s3_bucket, prefix, endpoint_url=s3_endpoint, backoff=0.001)
    chunk = sample_chunks(1)[0]
    store.put(chunk.key, chunk.data)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    base = f"{prefix}/" if prefix else ""
    foreign = [f"{base}backups/db.tar", f"{base}{chunk.key.namespace}/notes.tar", "elsewhere.bin"]
    for name in foreign:
        client.create_multipart_upload(Bucket=s3_bucket, Key=name)
    client.create_multipart_upload(Bucket=s3_bucket, Key=f"{base}{chunk.key.path}")
    assert [o.path.split("?")[0] for o in store.orphans()] == [f"{base}{chunk.key.path}"]
    assert store.remove_orphans(grace=0) == 1
    left = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert sorted(u["Key"] for u in left) == sorted(foreign)
    store.close()


@pytest.mark.parametrize("token", [None, "same"], ids=["no-token", "same-token"])
def test_truncated_listing_without_a_new_token_is_an_error_not_endless(
    s3_endpoint: str, s3_bucket: str, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server marking pages truncated without a (new) continuation token: asking again
    restarts the listing, so list() (and verify/prune over it) never ended."""
    store = make(s3_endpoint, s3_bucket)
    chunk = sample_chunks(1)[0]
    store.put(chunk.key, chunk.data)
    real = store._list_page

    async def broken(kwargs: dict[str, Any]) -> Any:
        page = await real({k: v for k, v in kwargs.items() if k != "ContinuationToken"})
        page["IsTruncated"] = True
        page["NextContinuationToken"] = token
        return page

    monkeypatch.setattr(store, "_list_page", broken)
    listed = []
    with pytest.raises(StoreError, match="truncated without a new continuation token"):
        for info in store.list():
            listed.append(info.key)
            assert len(listed) <= 2, "the listing restarted"
    store.close()


def paged_uploads(
    store: S3Store, monkeypatch: pytest.MonkeyPatch, *, fail_after: int | None = None
) -> list[dict[str, Any]]:
    """Make ``store``'s multipart-upload listings come in pages of 2, cut from moto's whole
    answer by the markers as S3 does (moto answers every upload at once); with
    ``fail_after``, every page after that many fails. Returns the pages' requests."""
    from chunkstore.backends import _s3

    real = store._request
    asked: list[dict[str, Any]] = []

    async def small_pages(op: str, **kwargs: Any) -> Any:
        if op != "list_multipart_uploads":
            return await real(op, **kwargs)
        asked.append(kwargs)
        if fail_after is not None and len(asked) > fail_after:
            raise _s3._Failed("listing broke")
        whole = await real(op, **{k: v for k, v in kwargs.items() if not k.endswith("Marker")})
        ordered = sorted(whole.get("Uploads", []), key=lambda u: (u["Key"], u["UploadId"]))
        after = (kwargs.get("KeyMarker", ""), kwargs.get("UploadIdMarker", ""))
        rest = [u for u in ordered if (u["Key"], u["UploadId"]) > after]
        page = {"Uploads": rest[:2], "IsTruncated": len(rest) > 2}
        if len(rest) > 2:
            page["NextKeyMarker"] = rest[1]["Key"]
            page["NextUploadIdMarker"] = rest[1]["UploadId"]
        return page

    monkeypatch.setattr(store, "_request", small_pages)
    return asked


def unfinished_uploads(s3_endpoint: str, s3_bucket: str, count: int, seed: int) -> list[str]:
    """``count`` chunks' multipart uploads begun and never finished; their object names."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    names = [chunk.key.path for chunk in sample_chunks(count, seed=seed)]
    for name in names:
        client.create_multipart_upload(Bucket=s3_bucket, Key=name)
    return names


def test_orphan_sweep_reads_every_page_of_unfinished_uploads(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 lists at most 1000 uploads a page: the sweep follows the markers to the end (pages
    of 2 here), or an orphan past the first page would never be aborted."""
    import boto3

    store = S3Store(s3_bucket, "", endpoint_url=s3_endpoint, backoff=0.001)
    names = unfinished_uploads(s3_endpoint, s3_bucket, 5, seed=31)
    pages = paged_uploads(store, monkeypatch)
    found = sorted(o.path.split("?")[0] for o in store.orphans(0))
    assert found == sorted(names) and len(pages) == 3
    assert store.remove_orphans(grace=0) == 5
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    store.close()


def test_orphan_sweep_keeps_the_pages_it_read_when_a_later_one_fails(
    s3_endpoint: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listing that fails after its first page: the orphans found so far are still swept
    (the sweep runs again next time for the rest)."""
    store = S3Store(s3_bucket, "", endpoint_url=s3_endpoint, backoff=0.001)
    unfinished_uploads(s3_endpoint, s3_bucket, 3, seed=32)
    paged_uploads(store, monkeypatch, fail_after=1)
    assert len(store.orphans(0)) == 2
    store.close()


def test_strays_split_into_shards_that_cover_them_once(s3_endpoint: str, s3_bucket: str) -> None:
    import boto3

    store = make(s3_endpoint, s3_bucket)
    chunks = sample_chunks(8, seed=41)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for chunk in chunks[:4]:
        client.create_multipart_upload(Bucket=s3_bucket, Key=f"p/{chunk.key.path}")
    ns = chunks[0].key.namespace
    foreign = [f"p/{c.key.path}.junk" for c in chunks[4:]] + [f"p/{ns}/junk.txt"]
    for name in foreign:
        client.put_object(Bucket=s3_bucket, Key=name, Body=b"x")
    whole = store.strays()
    shards = [store.strays((i, 3)) for i in range(3)]
    uploads = [f.path for s in shards for f in s.unfinished]
    assert sorted(uploads) == sorted(f.path for f in whole.unfinished) and len(uploads) == 4
    assert sorted(f.path for s in shards for f in s.foreign) == sorted(foreign)
    assert f"p/{ns}/junk.txt" in [f.path for f in shards[0].foreign]  # under no fan-out prefix
    assert store.remove_unfinished(shards[1].unfinished) == len(shards[1].unfinished)
    assert len(store.orphans()) == 4 - len(shards[1].unfinished)
    store.close()
