"""In CI the NIXL and Redis tests must run: a missing piece fails them instead of skipping.

Runs a few of the peer tests in a child pytest with NIXL disabled and ``redis-server``
off the PATH, once as CI (``CI=true``, as ``.ci/run`` runs) and once as a developer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
NEEDS_OPTIONAL = [
    "tests/peer/test_discovery.py::test_redis_registry_expire_heartbeat_withdraw",  # redis-server
    "tests/peer/test_faults.py::test_lease_expiry_frees_pins",  # NIXL
    "tests/peer/test_faults.py::test_corrupt_push_is_refused[nixl]",  # NIXL data plane
]


def run_without_nixl_and_redis(tmp_path: Path, *, ci: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CI"))}
    env["CHUNKSTORE_PEER_DISABLE_NIXL"] = "1"
    env["CHUNKSTORE_CHECK_TEST_DEPENDENCIES"] = "0"  # only the per-test rule is under test
    env["PATH"] = str(tmp_path)  # an empty directory: no redis-server
    if ci is not None:
        env["CI"] = ci
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", *NEEDS_OPTIONAL],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    return result.returncode, result.stdout + result.stderr


def test_missing_nixl_or_redis_fails_in_ci_and_skips_elsewhere(tmp_path: Path) -> None:
    code, output = run_without_nixl_and_redis(tmp_path, ci="true")
    assert code == 1, output
    assert "skipped" not in output, output
    for node in NEEDS_OPTIONAL:
        assert f"FAILED {node}" in output or f"ERROR {node}" in output, (node, output)
    assert "apt-get install -y redis-server" in output
    assert "pip install 'chunkstore[nixl]'" in output
    assert "CI must run this test" in output

    code, output = run_without_nixl_and_redis(tmp_path, ci=None)
    assert code == 0, output
    assert "3 skipped" in output, output
