"""PeerStore passes the store conformance suite, over each data plane."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from chunkstore.backends._memory import MemoryStore
from chunkstore.peer import PeerServer, PeerStore
from chunkstore.testing.store_suite import StoreSuite
from tests.peer.conftest import PLANES


@pytest.mark.parametrize("plane", PLANES, indirect=True)
class TestPeerStore(StoreSuite):
    # The suite stores damaged bytes on purpose, so the server must keep what it is given
    # (verify_push=False, an unverifying backing store) and the PeerStore must catch it.

    @pytest.fixture
    def make_store(self, plane: str) -> Iterator[Callable[[], PeerStore]]:
        server = PeerServer(
            MemoryStore(verify=False),
            verify_push=False,
            staging_bytes=4 << 20,
            use_env_secret=False,
        ).start()
        made: list[PeerStore] = []

        def make() -> PeerStore:
            store = PeerStore(
                [server.endpoint],
                plane=plane,
                timeout_s=10,
                recv_arena_bytes=4 << 20,
                use_env_secret=False,
            )
            made.append(store)
            return store

        yield make
        for store in made:
            store.close()
        server.stop()
