"""A node service killed with SIGKILL: engines get misses, then attach again to its successor."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkstore.node import NodeClient, NodeStore
from chunkstore.testing.factories import sample_chunks
from tests.node.conftest import SLOT_SIZE, Child, wait_until


def _serve(socket: Path) -> Child:
    child = Child(
        [
            sys.executable,
            "-m",
            "chunkstore.cli.main",
            "serve",
            "--slot-size",
            str(SLOT_SIZE),
            "--host-cache",
            str(SLOT_SIZE * 16),
            "--node",
            str(socket),
        ]
    )
    while not child.line().startswith("serving:"):
        pass
    return child


@pytest.fixture
def services() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.stop()


def test_engines_survive_a_killed_service_and_attach_to_the_next(
    tmp_path: Path, services: list[Child]
) -> None:
    socket = tmp_path / "node.sock"
    services.append(_serve(socket))
    chunks = sample_chunks(3, seed=11)
    keys = [c.key for c in chunks]
    items = [(c.key, c.data) for c in chunks]
    store = NodeStore(NodeClient(str(socket), slot_size=SLOT_SIZE, retry_after_s=0.05))
    try:
        assert store.put_many(items) == [True] * 3
        assert store.get_many(keys) == [c.data for c in chunks]

        services[0].kill()
        # Misses and refused writes, never an exception or a hang.
        assert store.get_many(keys) == [None] * 3
        assert store.lookup_prefix(keys) == 0
        assert store.put_many(items) == [False] * 3

        services.append(_serve(socket))  # replaces the dead one's socket and pool
        wait_until(lambda: store.put_many(items) == [True] * 3, "the engine to attach again")
        assert store.get_many(keys) == [c.data for c in chunks]
        assert store.lookup_prefix(keys) == 3
    finally:
        store.close()
