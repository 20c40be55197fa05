"""S3-compatible servers write an object's ETag quoted in some answers and bare in others
(a HEAD's header, a CopyObject's XML body): setting a corrupt chunk aside compares ETags by
value, so neither a corrupt object is kept nor a good one's copy left in quarantine over
the quoting."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

pytest.importorskip("s3fs")

from chunkstore.backends._s3 import S3Store  # noqa: E402

CHUNK = sample_chunks(1, seed=71)[0]
BAD = corrupt_copies(CHUNK)["bitflip"]


@pytest.fixture(params=["head_object", "copy_object"], ids=["bare-head", "bare-copy"])
def bare_etags(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answers HEAD (or CopyObject) with bare ETags; other answers keep quotes."""
    real = S3Store._attempt

    async def bare(self: S3Store, op: str, kwargs: dict[str, Any]) -> Any:
        got = await real(self, op, kwargs)
        if op != request.param:
            return got
        if op == "head_object" and "ETag" in got:
            got["ETag"] = got["ETag"].strip('"')
        if op == "copy_object":
            result = got.get("CopyObjectResult", {})
            result["ETag"] = str(result.get("ETag", "")).strip('"')
        return got

    monkeypatch.setattr(S3Store, "_attempt", bare)


@pytest.fixture(params=[True, False], ids=["conditional", "head-compare"])
def store(request: pytest.FixtureRequest, bare_etags: None) -> Iterator[S3Store]:
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    made = S3Store(
        bucket, "p", endpoint_url=endpoint, backoff=0.001, conditional_writes=request.param
    )
    yield made
    made.close()


def test_the_corrupt_object_read_is_set_aside(store: S3Store) -> None:
    store.put(CHUNK.key, BAD)
    [(raw, ident)] = store.read_unchecked_with_idents([CHUNK.key])
    assert bytes(raw) == BAD
    assert store.quarantine_if_unchanged(CHUNK.key, ident, "ChecksumMismatch") is True
    assert store.exists(CHUNK.key) is False
    assert len(store.quarantined()) == 1


def test_a_replaced_object_leaves_no_copy_in_quarantine(store: S3Store) -> None:
    """The object was replaced by a good one before the set-aside; moto, like some servers,
    ignores ``CopySourceIfMatch``, so the good one is copied, and the copy must go again."""
    store.put(CHUNK.key, BAD)
    [(_, ident)] = store.read_unchecked_with_idents([CHUNK.key])
    store.put(CHUNK.key, CHUNK.data)
    assert store.quarantine_if_unchanged(CHUNK.key, ident, "ChecksumMismatch") is False
    assert bytes(store.get(CHUNK.key) or b"") == CHUNK.data
    assert store.quarantined() == []
