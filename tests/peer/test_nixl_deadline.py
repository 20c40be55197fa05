"""A NIXL transfer past its deadline: the call fails, but only after NIXL says it ended.

Review finding #7: giving up on a transfer that UCX is still executing hands
its local memory (a receive-arena block, a host-cache slot) back while a late
RDMA completion can still land there. A scripted agent stands in for NIXL so
the "still in progress after the deadline" state is reached deterministically.

The same holds for a peer's agent removed (its last user let go: a client's request
timed out or it closed, a session ended on a server) while a transfer with it runs:
NIXL then fails that transfer at once, and releasing it does not stop the RMA
(measured with NIXL 1.5.1, UCX over TCP: bytes kept arriving after the release).
"""

from __future__ import annotations

import threading
from typing import Any

from chunkstore.peer._nixlplane import NixlEndpoint


class _Handle:
    def __init__(self, agent: _ScriptedAgent) -> None:
        self.agent = agent

    def release(self) -> None:
        # Like NIXL's UCX backend: releasing a transfer in progress does not stop its RMA.
        running = "done" not in self.agent.events
        self.agent.events.append("release while running" if running else "release")


class _ScriptedAgent:
    """Reports PROC for ``busy_polls`` state checks, then DONE (writing its data late)."""

    def __init__(self, target: bytearray, busy_polls: int) -> None:
        self.target = target
        self.busy_polls = busy_polls
        self.events: list[str] = []
        self.polled = threading.Event()
        self.finish = threading.Event()
        """Set: the transfer ends at the next check, however many busy polls are left."""
        self.removed = False

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.removed = False
        return metadata

    def remove_remote_agent(self, name: str) -> None:
        self.events.append("remove")
        self.removed = True

    def deregister_memory(self, descs: Any) -> None:
        self.events.append("deregister")

    def get_xfer_descs(self, descs: Any, kind: str) -> Any:
        return descs

    def initialize_xfer(self, op: str, local: Any, far: Any, remote: str) -> _Handle:
        return _Handle(self)

    def transfer(self, handle: _Handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: _Handle) -> str:
        self.polled.set()
        if self.removed:  # NIXL: "remote agent was invalidated during transfer"
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        if self.busy_polls > 0 and not self.finish.is_set():
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
    endpoint._remotes = {"peer": 1}
    endpoint._running = {}
    endpoint._unwanted = set()
    endpoint._closed = False
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


class _RunningRead:
    """A READ of 16 bytes from "peer" on another thread, in progress until :meth:`end`."""

    def __init__(self) -> None:
        self.agent = _ScriptedAgent(bytearray(16), busy_polls=10**9)
        self.endpoint = _endpoint(self.agent)
        self.endpoint._regions = [(0, 16, "registration")]
        self.result: list[bool] = []
        self._thread = threading.Thread(target=self._read)
        self._thread.start()
        assert self.agent.polled.wait(10)

    def _read(self) -> None:
        self.result.append(self.endpoint.read("peer", [(0, 0, 16)], float("inf")))

    def end(self) -> bool:
        """Let the transfer finish; what ``read`` returned."""
        self.agent.finish.set()
        self._thread.join(10)
        return self.result == [True]


def test_a_peer_let_go_during_a_transfer_is_removed_once_it_ended() -> None:
    # Another request to the same peer timed out (PeerClient._mark_down) while this READ
    # into a host slot runs: removing the agent then would fail the READ at once and hand
    # the slot back with the RMA still writing into it.
    read = _RunningRead()
    read.endpoint.remove_remote("peer")
    assert "remove" not in read.agent.events  # deferred: the transfer runs
    assert read.endpoint.read("peer", [(0, 0, 4)], float("inf")) is False  # no new one starts
    assert read.end()
    assert read.agent.events == ["done", "release", "remove"]


def test_a_peer_stays_while_another_user_holds_it() -> None:
    # Two clients sharing one plane loaded the same server's agent; one lets go (it was
    # marked down, or closed): the other's READs go on, and the agent goes with the last.
    read = _RunningRead()
    assert read.endpoint.add_remote(b"peer") == "peer"
    read.endpoint.remove_remote("peer")
    assert read.endpoint._remotes == {"peer": 1}  # new transfers with it still start
    read.endpoint.remove_remote("peer")
    assert "peer" not in read.endpoint._remotes  # none starts now...
    assert "remove" not in read.agent.events  # ...but the running READ keeps the agent
    assert read.end()
    assert read.agent.events == ["done", "release", "remove"]


def test_a_peer_added_again_before_its_transfer_ended_stays() -> None:
    read = _RunningRead()
    read.endpoint.remove_remote("peer")  # its last session ended...
    assert read.endpoint.add_remote(b"peer") == "peer"  # ...and a new one began
    assert read.end()
    assert read.agent.events == ["done", "release"]
    read.endpoint.remove_remote("peer")
    assert read.agent.events == ["done", "release", "remove"]


def test_closing_during_a_transfer_finishes_once_it_ended() -> None:
    # A store closed while another thread's READ into a host slot runs.
    read = _RunningRead()
    read.endpoint.close()
    assert read.agent.events == []
    assert read.end()
    assert read.agent.events == ["done", "release", "remove", "deregister"]


def test_a_closed_endpoint_takes_no_new_peer_and_starts_no_transfer() -> None:
    # A straggler (a fetch's release re-opening its client's session after the store
    # closed) adds its server again while another READ still keeps the memory registered:
    # the closed endpoint must refuse it, or READs start after close() and the agent
    # stays loaded for good.
    read = _RunningRead()
    read.endpoint.close()
    assert read.endpoint.add_remote(b"peer") is None
    assert read.endpoint.read("peer", [(0, 0, 4)], float("inf")) is False
    assert read.end()
    assert read.agent.events == ["done", "release", "remove", "deregister"]
