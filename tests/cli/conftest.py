"""Fixtures for CLI tests: frozen damaged stores, freshly written stores, and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.cli.main import main
from chunkstore.testing.factories import MadeChunk, sample_chunks
from tests.services import await_same

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
HOUR = 3600.0
DAY = 86400.0


@dataclass(frozen=True, slots=True)
class Result:
    """One CLI run."""

    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    """Run ``chunkstore ARGS...`` in-process; returns exit code and captured output."""

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            rc = main([str(a) for a in args])
        except SystemExit as exc:  # argparse errors and --help
            rc = int(exc.code or 0)
        captured = capsys.readouterr()
        return Result(rc, captured.out, captured.err)

    return run


def run_process(*args: object) -> subprocess.CompletedProcess[str]:
    """Run ``chunkstore ARGS...`` as a separate process (this tree's code, via sys.path), for
    inputs that could block it: the timeout only stops a regressed run from hanging the suite."""
    return subprocess.run(
        [sys.executable, "-m", "chunkstore.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )


def extract(name: str, dest: Path) -> Path:
    """Unpack ``tests/fixtures/<name>`` into ``dest`` (times as recorded in the tar)."""
    with tarfile.open(FIXTURES / name) as tar:
        tar.extractall(dest, filter="data")
    return dest


def rebase_times(root: Path, newest_age: float = HOUR) -> float:
    """Shift every file's times (and access records) so the newest is ``newest_age`` old.

    The frozen fixtures carry fixed 2025 dates; tests about ages need them
    relative to now, with the recorded gaps between chunks kept. Returns the shift.
    """
    files = [p for p in root.rglob("*") if p.is_file()]
    records = [p for p in files if p.name.endswith(".kvc.atime")]
    newest = max([p.stat().st_mtime for p in files] + [float(p.read_text()) for p in records])
    shift = time.time() - newest_age - newest
    for path in records:
        path.write_text(f"{float(path.read_text()) + shift:.3f}")
    for path in files:
        st = path.stat()
        os.utime(path, (st.st_mtime + shift, st.st_mtime + shift))
    return shift


@dataclass(frozen=True, slots=True)
class DamagedStore:
    """The extracted damaged-store fixture."""

    root: Path
    manifest: dict[str, Any]

    def key(self, name: str) -> str:
        return self.manifest["chunks"][name]["key"]

    def namespace(self, name: str) -> str:
        return self.manifest["chunks"][name]["namespace"]

    def path(self, name: str) -> Path:
        h = self.key(name)
        return self.root / self.namespace(name) / h[0:2] / h[2:4] / f"{h}.kvc"

    def names(self, status: str) -> set[str]:
        return {n for n, c in self.manifest["chunks"].items() if c["status"] == status}


def make_damaged(base: Path, seen: Path | None = None) -> DamagedStore:
    """The damaged-store fixture extracted under ``base``, times shifted so its newest file is
    an hour old. ``seen``: ``base`` through another mount of a shared volume, where the tests
    then look at the store (once that mount shows what was written)."""
    extract("damaged-store.tar.gz", base)
    rebase_times(base / "store")
    if seen is not None:
        files = sorted(p.relative_to(base) for p in base.rglob("*") if p.is_file())
        await_same([base / p for p in files], [seen / p for p in files])
    manifest = json.loads((base / "manifest.json").read_text())
    return DamagedStore((seen or base) / "store", manifest)


@pytest.fixture
def damaged(tmp_path: Path) -> DamagedStore:
    """The damaged-store fixture, times shifted so its newest file is an hour old."""
    return make_damaged(tmp_path / "fx")


@dataclass(frozen=True, slots=True)
class GoodStore:
    """A store written by FsStore during the test."""

    root: Path
    chunks: list[MadeChunk]
    written_at: Path | None = None
    """The same store through another mount of a shared volume, where the fixture writes and
    backdates it; None: at ``root``."""

    def set_times(self, index: int, *, written_ago: float, used_ago: float) -> None:
        """Backdate chunk ``index``: written and last used that many seconds ago."""
        now = time.time()
        relative = self.chunks[index].key.path
        path = (self.written_at or self.root) / relative
        os.utime(path, (now - used_ago, now - written_ago))
        if self.written_at is not None:
            await_same([path], [self.root / relative])


def make_good(root: Path, written_at: Path | None = None) -> GoodStore:
    """Eight valid 8 KiB chunks of one conversation, chunk i written and used (8 - i) days
    ago, written through ``written_at`` when given (``root`` through another mount)."""
    chunks = sample_chunks(8)
    with FsStore(str(written_at or root), create=True) as store:
        for chunk in chunks:
            store.put(chunk.key, chunk.data)
    made = GoodStore(root, chunks, written_at)
    for i in range(len(chunks)):
        made.set_times(i, written_ago=(8 - i) * DAY, used_ago=(8 - i) * DAY)
    return made


@pytest.fixture
def good(tmp_path: Path) -> GoodStore:
    """Eight valid 8 KiB chunks of one conversation, chunk i written and used (8 - i) days ago."""
    return make_good(tmp_path / "good")
