"""S3Store on a local moto server and on SeaweedFS passes the store conformance suite."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from chunkstore.testing.store_suite import StoreSuite
from tests.services import S3Service

pytest.importorskip("s3fs")

from chunkstore.backends._s3 import S3Store  # noqa: E402


class TestS3Store(StoreSuite):
    time_resolution = 1.05  # S3 LastModified has one-second resolution

    @pytest.fixture
    def s3_prefix(self) -> str:
        return "kv/cache"

    @pytest.fixture
    def make_store(self, s3_endpoint: str, s3_bucket: str, s3_prefix: str) -> Callable[[], S3Store]:
        return lambda: S3Store(
            s3_bucket, s3_prefix, endpoint_url=s3_endpoint, access_resolution=0, backoff=0.001
        )


@pytest.fixture(scope="module")
def seaweedfs_bucket(seaweedfs_s3: S3Service) -> str:
    """One bucket for the module, a prefix per test: SeaweedFS gives each bucket volumes of
    its own, and making them would be most of the cost of a test."""
    return seaweedfs_s3.new_bucket()


class TestS3StoreOnSeaweedFS(TestS3Store):
    """The same suite against SeaweedFS's S3 gateway, a real server (moto is a mock)."""

    @pytest.fixture
    def s3_endpoint(self, seaweedfs_s3: S3Service) -> str:
        return seaweedfs_s3.endpoint

    @pytest.fixture
    def s3_bucket(self, seaweedfs_bucket: str) -> str:
        return seaweedfs_bucket

    @pytest.fixture
    def s3_prefix(self) -> str:
        return f"kv/{uuid.uuid4().hex[:12]}"
