"""In CI the NIXL and Redis tests must run: a missing piece fails them instead of skipping.

Runs a few of the peer tests in a child pytest with NIXL disabled and ``redis-server``
off the PATH, once as CI (``CI=true``, as ``.ci/run`` runs) and once as a developer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.services import assert_all_failed_in_ci, run_child_pytest

pytestmark = pytest.mark.timeout(120)

NEEDS_OPTIONAL = [
    "tests/peer/test_discovery.py::test_redis_registry_expire_heartbeat_withdraw",  # redis-server
    "tests/peer/test_faults.py::test_lease_expiry_frees_pins",  # NIXL
    "tests/peer/test_faults.py::test_corrupt_push_is_refused[nixl]",  # NIXL data plane
]


def run_without_nixl_and_redis(tmp_path: Path, *, ci: str | None) -> tuple[int, str]:
    env = {"CHUNKSTORE_PEER_DISABLE_NIXL": "1", "PATH": str(tmp_path)}  # PATH: no redis-server
    return run_child_pytest(NEEDS_OPTIONAL, env, ci=ci, timeout=110)


def test_missing_nixl_or_redis_fails_in_ci_and_skips_elsewhere(tmp_path: Path) -> None:
    code, output = run_without_nixl_and_redis(tmp_path, ci="true")
    assert_all_failed_in_ci(code, output, NEEDS_OPTIONAL)
    assert "apt-get install -y redis-server" in output
    assert "pip install 'chunkstore[nixl]'" in output

    code, output = run_without_nixl_and_redis(tmp_path, ci=None)
    assert code == 0, output
    assert "3 skipped" in output, output
