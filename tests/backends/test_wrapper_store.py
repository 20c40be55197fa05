"""WrapperStore forwards everything: a wrapped store still passes the conformance suite."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.backends._wrapper import WrapperStore
from chunkstore.backends.base import Store
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import StoreSuite


class TestWrapperStore(StoreSuite):
    persistent = False

    @pytest.fixture
    def make_store(self) -> Callable[[], Store]:
        return lambda: WrapperStore(MemoryStore(name="inner"))


def test_name_kind_and_capabilities_are_the_inner_stores() -> None:
    inner = MemoryStore(name="inner")
    store = WrapperStore(inner)
    assert (store.name, store.kind) == ("inner", "memory")
    assert store.supports_listing and store.atomic_put and not store.high_latency
    chunk = sample_chunks(1)[0]
    store.put(chunk.key, chunk.data)
    assert inner.get(chunk.key) == chunk.data
    store.close()
    assert inner.get(chunk.key) is None  # closing the wrapper closed the memory store
