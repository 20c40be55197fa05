"""FsStore on a JuiceFS volume passes the store conformance suite across two mounts.

Each new store object of a test is opened through the other mount than the last one (the
same volume, as a second node sees it): what one wrote, the next one reads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import StoreSuite
from tests.services import JuiceFsVolume


class TestJuiceFsStore(StoreSuite):
    @pytest.fixture
    def make_store(self, juicefs: JuiceFsVolume) -> Callable[[], FsStore]:
        place = juicefs.fresh("suite")
        return lambda: FsStore(str(juicefs.alternate(place) / "cache"), create=True)


def test_put_if_absent_has_one_winner_across_mounts(juicefs: JuiceFsVolume) -> None:
    """Two nodes racing to store the same chunks: the volume's hard link decides, so each key
    is won exactly once, and both nodes then read the winner's bytes."""
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
    finally:
        for store in stores:
            store.close()
