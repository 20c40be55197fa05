"""A moto S3 server on 127.0.0.1 for the S3 store tests (one per session, random free port)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a ThreadedMotoServer; AWS credentials are dummies set in the environment."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    port = _free_port()
    # werkzeug logs every request and, with no handler configured, binds one to whatever
    # sys.stderr is at that moment (a test capture that is closed later): keep it quiet.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="session")
def s3_admin(s3_endpoint: str) -> Any:
    """A boto3 client for test setup (made once: a client costs ~0.2 s to build)."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_admin: Any) -> str:
    """A new, empty bucket."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_admin.create_bucket(Bucket=name)
    return name
