"""Fixtures for the peer tests: in-process servers and data planes.

Optional pieces (pyzmq/msgpack, NIXL, redis-server) skip their tests on a developer
machine that lacks them, but FAIL them in CI (``$CI`` set, as ``.ci/run`` runs): issue 5
requires the NIXL and Redis tests to run there, so a broken install must turn CI red,
not green with skips. The throwaway redis-server is ``tests/services.py``'s.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.services import in_ci, unavailable

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
