"""The CLI over a store on a JuiceFS volume, written through one mount and run through the other.

Representative ``ls``, ``verify``, ``prune`` and ``inspect`` tests, collected here again
with their ``good`` and ``damaged`` stores on the shared volume: the fixtures write and
backdate through the first mount (a writer node) and hand the tests the second one (an
operator's node), once it shows what was written.
"""

from __future__ import annotations

import pytest

from tests.cli.conftest import DamagedStore, GoodStore, make_damaged, make_good
from tests.cli.test_inspect import test_inspect_changes_nothing, test_inspect_json_counts_everything
from tests.cli.test_ls import (
    test_ls_table_lists_every_chunk_with_size_and_ages,
    test_ls_used_column_reflects_reads,
)
from tests.cli.test_prune import (
    test_max_bytes_removes_least_recently_used_first,
    test_older_than_uses_last_use_not_write_time,
    test_prune_respects_access_records,
    test_prune_sweeps_old_orphans_and_leaves_foreign,
)
from tests.cli.test_verify import (
    test_verify_does_not_count_as_use,
    test_verify_quarantines_exactly_the_corrupt_chunks,
    test_verify_removes_old_orphans_and_keeps_young_ones,
)
from tests.services import JuiceFsVolume

__all__ = [
    "test_inspect_changes_nothing",
    "test_inspect_json_counts_everything",
    "test_ls_table_lists_every_chunk_with_size_and_ages",
    "test_ls_used_column_reflects_reads",
    "test_max_bytes_removes_least_recently_used_first",
    "test_older_than_uses_last_use_not_write_time",
    "test_prune_respects_access_records",
    "test_prune_sweeps_old_orphans_and_leaves_foreign",
    "test_verify_does_not_count_as_use",
    "test_verify_quarantines_exactly_the_corrupt_chunks",
    "test_verify_removes_old_orphans_and_keeps_young_ones",
]


@pytest.fixture
def good(juicefs: JuiceFsVolume) -> GoodStore:
    written, seen = juicefs.fresh("cli")
    return make_good(seen / "good", written_at=written / "good")


@pytest.fixture
def damaged(juicefs: JuiceFsVolume) -> DamagedStore:
    written, seen = juicefs.fresh("cli")
    return make_damaged(written / "fx", seen / "fx")
