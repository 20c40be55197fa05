"""``tools/bench_sharing.py``'s prune part runs against the index as it is (``make bench``
runs it; a callback that drifted from the index's signature crashed it there)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench_sharing.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_sharing", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_sharing"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["bench_sharing"]
    return module


def _evicted(output: str) -> list[int]:
    """The ``evicted`` column of each row the prune tables print."""
    rows = [line.split() for line in output.splitlines()]
    return [int(row[4]) for row in rows if len(row) >= 5 and row[0].isdigit()]


def test_a_prune_pass_evicts_one_percent_by_a_walk_and_through_the_index(
    bench: ModuleType, tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bench.bench_prune("local directory", tmp_path, redis_url, (1000,))
    assert _evicted(capsys.readouterr().out) == [10]
    assert list(tmp_path.iterdir()) == []  # the store it made is gone


def test_the_index_alone_evicts_one_percent_of_entries_with_no_files(
    bench: ModuleType, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bench.bench_index_alone(redis_url, 1000)
    assert _evicted(capsys.readouterr().out) == [10]
