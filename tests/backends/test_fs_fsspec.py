"""FsStore through a non-local fsspec filesystem (fsspec's in-memory one) passes the suite."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import fsspec
import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._fsio import FsspecIO
from chunkstore.testing.stateful import store_state_machine
from chunkstore.testing.store_suite import StoreSuite


class TestFsspecMemoryFsStore(StoreSuite):
    @pytest.fixture
    def make_store(self) -> Iterator[Callable[[], FsStore]]:
        # Note: memory:// URLs open MemoryStore through the registry, so build the fs directly.
        fs = fsspec.filesystem("memory")
        root = f"/suite-{uuid.uuid4().hex}"

        def make() -> FsStore:
            store = FsStore(root, fs=fs, create=True)
            assert isinstance(store.io, FsspecIO)
            return store

        yield make
        fs.rm(root, recursive=True)


_FS = fsspec.filesystem("memory")
TestFsspecMemoryFsStoreMachine = store_state_machine(
    lambda: FsStore(f"/sm-{uuid.uuid4().hex}", fs=_FS, create=True),
    lambda store: _FS.rm(store.root, recursive=True),  # type: ignore[attr-defined]
).TestCase
