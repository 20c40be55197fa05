"""Fixtures for the peer tests: in-process servers, data planes, a throwaway redis-server.

Optional pieces (pyzmq/msgpack, NIXL, redis-server) skip their tests on a developer
machine that lacks them, but FAIL them in CI (``$CI`` set, as ``.ci/run`` runs): issue 5
requires the NIXL and Redis tests to run there, so a broken install must turn CI red,
not green with skips.
"""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def in_ci() -> bool:
    """Whether this run is CI's: ``$CI`` set to anything but empty/0/false/no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(what: str, install: str) -> None:
    """Skip the current test because ``what`` is missing here; in CI, fail it instead."""
    if in_ci():
        pytest.fail(
            f"{what}; CI must run this test, not skip it. Install it: {install}", pytrace=False
        )
    pytest.skip(f"{what} (install: {install})")


for _module in ("zmq", "msgpack"):
    try:
        importlib.import_module(_module)
    except ImportError:
        if in_ci():
            raise ImportError(
                f"{_module} is missing; CI must run the peer tests. "
                "Install it: pip install 'chunkstore[peer]'"
            ) from None
        pytest.skip(
            f"{_module} is not installed (pip install 'chunkstore[peer]')",
            allow_module_level=True,
        )

from chunkstore.peer import PeerServer  # noqa: E402
from chunkstore.peer._nixlplane import nixl_unavailable_reason  # noqa: E402

NIXL_INSTALL = "pip install 'chunkstore[nixl]' (tools/install.sh pins nixl and nixl-cu12)"
PLANES = ["inline", "nixl"]


def require_nixl() -> None:
    """Call first in a test that needs NIXL: skips without it, fails in CI."""
    reason = nixl_unavailable_reason()
    if reason is not None:
        unavailable(f"NIXL is unavailable: {reason}", NIXL_INSTALL)


@pytest.fixture(params=PLANES)
def plane(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once per data plane (nixl: skipped without it, failed in CI)."""
    if request.param == "nixl":
        require_nixl()
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
    """A private redis-server on a random loopback port (skipped without it, failed in CI)."""
    binary = shutil.which("redis-server")
    if binary is None:
        unavailable("redis-server is not installed", "apt-get install -y redis-server")
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
