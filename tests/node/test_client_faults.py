"""NodeClient when the service cannot be used: its pool is not visible or of another
release (one line at attach, misses afterwards), or it is frozen (never a hang)."""

from __future__ import annotations

import errno
import socket
import threading
from pathlib import Path

import pytest

import chunkstore.node._client as client_module
from chunkstore.cache import _pool
from chunkstore.node import NodeClient, NodeRefused
from chunkstore.testing.factories import sample_chunks
from tests.node.conftest import SLOT_SIZE


def test_a_pool_the_engine_cannot_see_is_one_line_at_attach(node, tmp_path, monkeypatch) -> None:
    elsewhere = tmp_path / "engine-shm"  # an engine container with its own /dev/shm
    elsewhere.mkdir()
    monkeypatch.setattr(client_module, "SHM_DIR", elsewhere)
    client = NodeClient(node.socket, slot_size=SLOT_SIZE)
    with pytest.raises(NodeRefused, match="share /dev/shm"):
        client.attach()
    client.close()


def test_a_pool_of_another_release_is_a_miss_not_a_traceback(node, monkeypatch) -> None:
    monkeypatch.setattr(_pool, "VERSION", _pool.VERSION + 1)  # the engine's release is newer
    client = NodeClient(node.socket, slot_size=SLOT_SIZE)
    key = sample_chunks(1)[0].key
    assert client.lookup([key]) == 0
    assert client.refusal is not None and "slot pool" in client.refusal
    client.close()


def test_a_frozen_service_never_blocks_the_engine(tmp_path: Path) -> None:
    # A service that stopped accepting (SIGSTOP, a paused container) with its listen backlog
    # full: connecting would wait for ever; the client must answer misses instead.
    path = tmp_path / "node.sock"
    frozen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    frozen.bind(str(path))
    frozen.listen(1)
    queued = []
    while True:  # fill the backlog
        waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        waiting.setblocking(False)
        try:
            waiting.connect(str(path))
        except OSError as exc:
            assert exc.errno == errno.EAGAIN
            waiting.close()
            break
        queued.append(waiting)
    client = NodeClient(str(path), slot_size=SLOT_SIZE, timeout_s=0.2, retry_after_s=0.0)
    key = sample_chunks(1)[0].key
    answered = []
    engine = threading.Thread(
        target=lambda: answered.extend(client.lookup([key]) for _ in range(5)), daemon=True
    )
    engine.start()
    engine.join(timeout=60)  # a guard against a hang, not a timing assertion
    hung = engine.is_alive()
    for waiting in queued:
        waiting.close()
    frozen.close()  # ends a blocked connect, if any
    engine.join(timeout=10)
    client.close()
    assert not hung
    assert answered == [0] * 5
