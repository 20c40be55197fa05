"""MemoryStore passes the store conformance suite."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.testing.stateful import store_state_machine
from chunkstore.testing.store_suite import StoreSuite


class TestMemoryStore(StoreSuite):
    persistent = False

    @pytest.fixture
    def make_store(self) -> Callable[[], MemoryStore]:
        return MemoryStore


TestMemoryStoreMachine = store_state_machine(MemoryStore).TestCase
