"""FsStore on a local directory (the os fast path) passes the store conformance suite."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._fsio import LocalIO
from chunkstore.testing.stateful import store_state_machine
from chunkstore.testing.store_suite import StoreSuite


class TestLocalFsStore(StoreSuite):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> Callable[[], FsStore]:
        def make() -> FsStore:
            store = FsStore(str(tmp_path / "cache"), create=True)
            assert isinstance(store.io, LocalIO)
            return store

        return make


TestLocalFsStoreMachine = store_state_machine(
    lambda: FsStore(tempfile.mkdtemp(prefix="chunkstore-sm-"), access_resolution=0),
    lambda store: shutil.rmtree(store.root, ignore_errors=True),  # type: ignore[attr-defined]
).TestCase
