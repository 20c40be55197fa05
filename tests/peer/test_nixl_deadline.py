"""A NIXL transfer past its deadline: the call fails, but only after NIXL says it ended.

Review finding #7: giving up on a transfer that UCX is still executing hands
its local memory (a receive-arena block, a host-cache slot) back while a late
RDMA completion can still land there. A scripted agent stands in for NIXL so
the "still in progress after the deadline" state is reached deterministically.
"""

from __future__ import annotations

import threading
from typing import Any

from chunkstore.peer._nixlplane import NixlEndpoint


class _Handle:
    def __init__(self, agent: _ScriptedAgent) -> None:
        self.agent = agent

    def release(self) -> None:
        self.agent.events.append("release")


class _ScriptedAgent:
    """Reports PROC for ``busy_polls`` state checks, then DONE (writing its data late)."""

    def __init__(self, target: bytearray, busy_polls: int) -> None:
        self.target = target
        self.busy_polls = busy_polls
        self.events: list[str] = []

    def get_xfer_descs(self, descs: Any, kind: str) -> Any:
        return descs

    def initialize_xfer(self, op: str, local: Any, far: Any, remote: str) -> _Handle:
        return _Handle(self)

    def transfer(self, handle: _Handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: _Handle) -> str:
        if self.busy_polls > 0:
            self.busy_polls -= 1
            return "PROC"
        self.target[:] = b"late" * (len(self.target) // 4)  # the RDMA completion lands
        self.events.append("done")
        return "DONE"


def _endpoint(agent: _ScriptedAgent) -> NixlEndpoint:
    endpoint = NixlEndpoint.__new__(NixlEndpoint)  # no real NIXL agent: the scripted one
    endpoint.name = "scripted"
    endpoint._agent = agent
    endpoint._regions = []
    endpoint._remotes = {}
    endpoint._lock = threading.Lock()
    endpoint._leaked = []
    return endpoint


def test_overdue_read_returns_only_after_the_transfer_ended() -> None:
    target = bytearray(16)
    agent = _ScriptedAgent(target, busy_polls=300)
    endpoint = _endpoint(agent)
    assert endpoint.read("peer", [(0, 0, len(target))], deadline=0.0) is False  # long past
    # When read() returns, the caller frees or reuses `target`: nothing may write it later.
    assert agent.events == ["done", "release"]
    assert bytes(target) == b"late" * 4 and agent.busy_polls == 0


def test_transfer_within_its_deadline_succeeds() -> None:
    target = bytearray(8)
    agent = _ScriptedAgent(target, busy_polls=3)
    endpoint = _endpoint(agent)
    assert endpoint.read("peer", [(0, 0, len(target))], deadline=float("inf")) is True
    assert agent.events == ["done", "release"]
