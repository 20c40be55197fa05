"""Fixtures for the peer tests: in-process servers, data planes, a throwaway redis-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from chunkstore.backends.peer import PeerServer  # noqa: E402
from chunkstore.backends.peer.nixlplane import nixl_unavailable_reason  # noqa: E402

NIXL_REASON = nixl_unavailable_reason()
PLANES = [
    "inline",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(NIXL_REASON is not None, reason=str(NIXL_REASON))
    ),
]


@pytest.fixture(params=PLANES)
def plane(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once per data plane."""
    return str(request.param)


@pytest.fixture
def serve() -> Iterator[Callable[..., PeerServer]]:
    """Start in-process servers (small staging arenas); all stopped at teardown."""
    servers: list[PeerServer] = []

    def start(store: Any, **config: Any) -> PeerServer:
        config.setdefault("staging_bytes", 4 << 20)
        config.setdefault("use_env_secret", False)
        server = PeerServer(store, **config).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a random loopback port (skips when it is not installed)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
