"""S3Store on a local moto server passes the store conformance suite."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from chunkstore.testing.store_suite import StoreSuite

pytest.importorskip("s3fs")

from chunkstore.backends._s3 import S3Store  # noqa: E402


class TestS3Store(StoreSuite):
    time_resolution = 1.05  # S3 LastModified has one-second resolution

    @pytest.fixture
    def make_store(self, s3_endpoint: str, s3_bucket: str) -> Callable[[], S3Store]:
        return lambda: S3Store(
            s3_bucket, "kv/cache", endpoint_url=s3_endpoint, access_resolution=0, backoff=0.001
        )
