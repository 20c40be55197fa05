"""FsStore on a JuiceFS volume passes the store conformance suite across two mounts.

Each new store object of a test is opened through the other mount than the last one (the
same volume, as a second node sees it): what one wrote, the next one reads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from chunkstore.backends import _fsio as fsio
from chunkstore.backends._fs import FsStore
from chunkstore.backends._fsio import LocalIO
from chunkstore.backends._layout import MARKER_NAME
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import StoreSuite
from tests.services import JuiceFsVolume


class TestJuiceFsStore(StoreSuite):
    replace_may_miss = True  # a read racing a rename over the file may find no file

    @pytest.fixture
    def make_store(self, juicefs: JuiceFsVolume) -> Callable[[], FsStore]:
        place = juicefs.fresh("suite")
        return lambda: FsStore(str(juicefs.alternate(place) / "cache"), create=True)


def test_put_if_absent_has_one_winner_across_mounts(juicefs: JuiceFsVolume) -> None:
    """Two nodes racing to store the same chunks: the volume's rename that refuses an
    existing name decides (JuiceFS has it, so neither node falls back to hard links), so each
    key is won exactly once, and both nodes then read the winner's bytes."""
    places = juicefs.fresh("race")
    stores = [FsStore(str(place / "cache"), create=True) for place in places]
    chunks = sample_chunks(24, seed=5)
    wins: list[list[bool]] = [[], []]
    barrier = threading.Barrier(2)

    def race(side: int) -> None:
        barrier.wait(timeout=30)
        wins[side] = [stores[side].put_if_absent(c.key, c.data) for c in chunks]

    threads = [threading.Thread(target=race, args=(side,)) for side in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    try:
        assert [a + b for a, b in zip(*wins, strict=True)] == [1] * len(chunks)
        for store in stores:
            assert [bytes(store.get(c.key) or b"") for c in chunks] == [c.data for c in chunks]
            assert store.corrupt_detected == 0
            assert isinstance(store.io, LocalIO) and store.io._noreplace
    finally:
        for store in stores:
            store.close()


def test_a_second_creator_leaves_the_layout_marker_in_place(
    juicefs: JuiceFsVolume, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes that start on a new store at once may each find it without a layout marker and
    each write one. Replacing a marker already there breaks a node that is reading it: on
    JuiceFS a file replaced through another mount vanishes under an open descriptor (ENOENT
    from fstat, EBADF from read), and that node refused to open the store."""
    here, there = (str(place / "store") for place in juicefs.fresh("marker"))
    FsStore(here, create=True).close()  # the first creator
    real_kind, real_read_small, real_fstat = LocalIO.kind, LocalIO.read_small, fsio._regular_fstat
    raced: list[str] = []

    def once_on_here(real: Callable[..., Any], stand_in: object) -> Callable[..., Any]:
        calls: list[str] = []

        def call(self: LocalIO, path: str) -> Any:
            if path.startswith(here) and not calls:
                calls.append(path)
                return stand_in
            return real(self, path)

        return call

    def second_creator_writes() -> None:
        # It looked before the first creator had made anything, and writes its marker now.
        with monkeypatch.context() as racing:
            racing.setattr(LocalIO, "kind", once_on_here(real_kind, "missing"))
            racing.setattr(LocalIO, "read_small", once_on_here(real_read_small, None))
            FsStore(here, create=True).close()

    def fstat_as_the_second_creator_writes(fd: int, path: str) -> os.stat_result:
        if path.startswith(there) and path.endswith(MARKER_NAME) and not raced:
            raced.append(path)
            second_creator_writes()  # between this node's open of the marker and its fstat
        return real_fstat(fd, path)

    monkeypatch.setattr(fsio, "_regular_fstat", fstat_as_the_second_creator_writes)
    with FsStore(there, create=True) as store:  # a node opening the store meanwhile
        chunk = sample_chunks(1)[0]
        assert store.put(chunk.key, chunk.data)
    assert raced
    with FsStore(here) as store:
        assert bytes(store.get(chunk.key) or b"") == chunk.data
