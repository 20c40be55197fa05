"""Fixtures for the node service tests: an in-process service, engine processes, polling."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq", reason="the node service needs pyzmq (pip install 'chunkstore[peer]')")

from chunkstore.backends._memory import MemoryStore  # noqa: E402
from chunkstore.cache import HostCache  # noqa: E402
from chunkstore.cache._pool import WRITING  # noqa: E402
from chunkstore.format import ATTENTION, ChunkLayout, KVSpec, LayerGroup  # noqa: E402
from chunkstore.node import NodeServer  # noqa: E402
from chunkstore.peer import PeerMetrics  # noqa: E402
from chunkstore.testing.factories import sample_chunks, small_spec  # noqa: E402
from chunkstore.tiering import TieredStore

REPO = Path(__file__).resolve().parents[2]
PATIENCE_S = 60.0
"""How long a test waits for something that must happen (generous: the machine is shared)."""

SLOT_SIZE = len(sample_chunks(1)[0].data)
"""The chunk size of the test conversations (what every simulated engine uses)."""


ENGINE_START_S = 600.0
"""How long a test waits for a vLLM engine process to start and serve its first request."""


def wait_until(condition: Callable[[], bool], what: str, patience: float = PATIENCE_S) -> None:
    """Poll ``condition`` until true; fail naming ``what`` after ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def child_env() -> dict[str, str]:
    """The environment of a child process: this tree first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("CHUNKSTORE_PEER_SECRET", None)
    return env


class Child:
    """A child process whose printed lines are collected by a thread (no blocking reads)."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            args, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, text=True
        )
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def line(self) -> str:
        """The next line it prints (fails after :data:`PATIENCE_S`, or when it exits)."""
        try:
            line = self._lines.get(timeout=PATIENCE_S)
        except queue.Empty:
            self.proc.kill()
            pytest.fail("a child process printed nothing in time")
        if line is None:
            pytest.fail(f"the child process ended (exit code {self.proc.wait()})")
        return line

    def kill(self) -> None:
        """SIGKILL, and reap it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM if still running, and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=PATIENCE_S)


def spawn(*args: str) -> Child:
    """A simulated engine (:mod:`tests.node.clientproc`) with ``args``."""
    return Child([sys.executable, "-m", "tests.node.clientproc", *args])


@dataclass
class Node:
    """An in-process node service."""

    server: NodeServer
    store: TieredStore
    tier: MemoryStore
    socket: str
    metrics: PeerMetrics

    @property
    def host(self) -> HostCache:
        return self.store.host


def start_node(tmp_path: Path, slot_size: int = SLOT_SIZE, **config: Any) -> Node:
    """A node service over a host cache (shared pool of 16 ``slot_size`` slots) with one
    memory tier behind it."""
    from prometheus_client import CollectorRegistry

    from chunkstore.metrics import ChunkstoreMetrics

    host = HostCache(
        slot_size, num_slots=16, shm_name=f"cs-test-{os.getpid()}-{tmp_path.name}", pin_memory=False
    )
    tier = MemoryStore()
    store = TieredStore(host, [tier], metrics=ChunkstoreMetrics(CollectorRegistry()))
    metrics = PeerMetrics(CollectorRegistry())
    socket = str(tmp_path / "node.sock")
    config.setdefault("use_env_secret", False)
    server = NodeServer(
        store, bind=f"ipc://{socket}", planes=("shm",), name="node", metrics=metrics, **config
    ).start()
    return Node(server, store, tier, socket, metrics)


def states(node: Node, state: int) -> int:
    """How many slots of the node's pool are in ``state``."""
    pool = node.host.pool
    with pool:
        return sum(1 for slot in range(pool.num_slots) if pool.state(slot) == state)


def quiet(node: Node) -> bool:
    """No pin, no lease and no half-written slot anywhere in the pool."""
    stats = node.server.stats()
    return (
        node.host.pool.pinned_slots() == 0
        and states(node, WRITING) == 0
        and stats["leases"] == 0
        and stats["pins"] == 0
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """A running in-process node service."""
    started = start_node(tmp_path)
    try:
        yield started
    finally:
        started.server.stop()
        started.store.close()


@pytest.fixture
def sealing_node(tmp_path: Path) -> Iterator[Node]:
    """A node service that knows the model's layout, so it can seal TP ranks' chunks."""
    started = start_node(tmp_path, seal_layout=ChunkLayout(small_spec()))
    try:
        yield started
    finally:
        started.server.stop()
        started.store.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, 2 KV heads of 32) for real vLLM engines and harnesses."""
    pytest.importorskip("vllm")
    from chunkstore.vllm.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def engine_chunk_size(model_dir: Path) -> int:
    """The chunk size of :func:`tiny_model` engines with 64-token chunks in bf16 (what a node
    serving them must use as its slot size)."""
    group = LayerGroup(ATTENTION, (0, 1), num_kv_heads=2, head_dim=32)
    return ChunkLayout(KVSpec(str(model_dir), "BF16", 64, (group,))).total_size
