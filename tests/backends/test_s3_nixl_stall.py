"""A stalled NIXL OBJ transfer with a caller's buffer is waited for, never abandoned.

The S3 store reads straight into the caller's buffer (``get_into``: a host-cache
slot) and PUTs from it. Abandoning such a transfer after ``stall_limit`` returned a
miss while the AWS SDK could still write the slot, which the host cache then hands
to another chunk and trusts on hits. Only a buffer the data path allocated itself
may be abandoned (it stays referenced for good). A scripted agent stands in for
NIXL so that the stall is reached deterministically.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any

from chunkstore.backends._s3_nixl import NixlObjDataPath


class _Handle:
    def __init__(self, agent: _StallingAgent, address: int, length: int) -> None:
        self.agent = agent
        self.address, self.length = address, length

    def release(self) -> None:
        self.agent.events.append("release")


class _StallingAgent:
    """Reports PROC for ``busy_polls`` state checks, then writes ``late`` at the transfer's
    local address (the SDK's GET landing) and reports DONE."""

    def __init__(self, busy_polls: int) -> None:
        self.busy_polls = busy_polls
        self.events: list[str] = []

    def register_memory(self, descs: Any, kind: str, backends: Any = ()) -> Any:
        return descs

    def deregister_memory(self, registration: Any, backends: Any = ()) -> None:
        pass

    def get_xfer_descs(self, descs: Any, kind: str) -> Any:
        return descs

    def initialize_xfer(self, op: str, local: Any, far: Any, name: str) -> _Handle:
        ((address, length, _),) = local
        return _Handle(self, address, length)

    def transfer(self, handle: _Handle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: _Handle) -> str:
        if self.busy_polls > 0:
            self.busy_polls -= 1
            return "PROC"
        ctypes.memmove(handle.address, b"late" * (handle.length // 4), handle.length)
        self.events.append("done")
        return "DONE"


def _data_path(agent: _StallingAgent) -> NixlObjDataPath:
    path = NixlObjDataPath.__new__(NixlObjDataPath)  # no NIXL: the scripted agent
    path.where = path.name = "s3://scripted"
    path._agent = agent
    path._sizes = lambda names: [4] * len(names)
    path._stall_limit = 0.0  # every transfer counts as stalled at its first look
    path.failed_transfers = 0
    path._ids = itertools.count(1)
    path._lock = threading.Lock()
    path._abandoned = []
    path._empty = bytearray(1)
    return path


def test_a_stalled_read_into_the_callers_buffer_is_waited_for() -> None:
    agent = _StallingAgent(busy_polls=50)
    path = _data_path(agent)
    slot = bytearray(8)
    assert path.read_into("kv/cache/ab/cd/abcd.kvc", memoryview(slot)) == 4
    # Returned only once the SDK was done with the slot: nothing writes it afterwards.
    assert agent.events == ["done", "release"]
    assert bytes(slot[:4]) == b"late" and path._abandoned == []


def test_a_stalled_read_into_its_own_buffer_is_abandoned_with_it() -> None:
    agent = _StallingAgent(busy_polls=10**9)
    path = _data_path(agent)
    assert path.read_many(["kv/cache/ab/cd/abcd.kvc"]) == [None]
    assert len(path._abandoned) == 1 and agent.events == []  # still running, kept referenced


def test_a_stalled_put_from_the_callers_buffer_is_waited_for() -> None:
    # A PUT abandoned while the SDK still reads the slot would upload whatever chunk the
    # host cache put there next, under this chunk's name.
    agent = _StallingAgent(busy_polls=50)
    path = _data_path(agent)
    assert path.write_many([("kv/cache/ab/cd/abcd.kvc", bytearray(4))]) == [True]
    assert agent.events == ["done", "release"] and path._abandoned == []


def test_closing_during_a_stalled_read_into_the_callers_buffer_still_waits_for_it() -> None:
    # store.close() drops the path's agent while another thread waits for a GET into a
    # host slot: the wait must go on with the agent that posted the transfer, not turn
    # into a miss that hands the slot back while the SDK may still write it.
    agent = _StallingAgent(busy_polls=10**9)
    polled = threading.Event()
    finish = threading.Event()
    checks = agent.check_xfer_state

    def check_until_finished(handle: _Handle) -> str:
        polled.set()
        if finish.is_set():
            agent.busy_polls = 0
        return checks(handle)

    agent.check_xfer_state = check_until_finished  # type: ignore[method-assign]
    path = _data_path(agent)
    slot = bytearray(8)
    result: list[int | None] = []
    reader = threading.Thread(
        target=lambda: result.append(path.read_into("kv/cache/ab/cd/abcd.kvc", memoryview(slot)))
    )
    reader.start()
    assert polled.wait(10)
    path.close()  # returns at once: closing never waits for the SDK
    assert agent.events == []  # nothing released under the running transfer
    finish.set()
    reader.join(10)
    assert result == [4] and agent.events == ["done", "release"]
    assert bytes(slot[:4]) == b"late"
