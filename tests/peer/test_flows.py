"""Multi-process flows on loopback: prefill/decode pulls and offload pushes, per data plane."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import pytest

from tests.peer import procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CTX = mp.get_context("spawn")


class Server:
    """A prefill-style server process."""

    def __init__(
        self,
        seed: int,
        count: int,
        store_kind: str = "memory",
        capacity_chunks: int = 64,
        **config: Any,
    ) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(
            target=procs.prefill_server,
            args=(child, seed, count, store_kind, config, capacity_chunks),
        )
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("server process did not start")
        _, self.endpoint, self.pid, self.planes = self.conn.recv()

    def ask(self, message: str) -> Any:
        self.conn.send(message)
        assert self.conn.poll(30)
        return self.conn.recv()

    def stop(self) -> dict[str, Any] | None:
        if not self.proc.is_alive():
            return None
        self.conn.send("stop")
        stats = self.conn.recv()[1] if self.conn.poll(30) else None
        self.proc.join(30)
        return stats

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)


def run(target: Any, *args: Any) -> dict[str, Any]:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=target, args=(child, *args))
    proc.start()
    assert parent.poll(90), "client process did not report"
    result: dict[str, Any] = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0
    return result


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        if server.proc.is_alive():
            server.kill()


@pytest.mark.parametrize("store_kind", ["memory", "host"])
def test_decode_pulls_what_prefill_computed(
    plane: str, store_kind: str, servers: list[Server]
) -> None:
    prefill = Server(seed=7, count=12, store_kind=store_kind)
    servers.append(prefill)
    result = run(procs.decode_pull, [prefill.endpoint], 7, 16, plane, {})
    assert result["prefix"] == 12
    assert result["matches"] == 12
    assert result["corrupt"] == 0
    assert result["planes"] == {prefill.endpoint: plane}
    stats = prefill.stop()
    assert stats is not None
    assert stats["counts"]["chunks_hit"] == 12
    assert stats["leases"] == 0 and stats["pins"] == 0  # every NIXL lease was released
    if plane == "nixl" and store_kind == "host":  # slots READ in place, no staging copy
        assert stats["counts"]["served_in_place"] == 12


def test_three_processes_decode_picks_the_longest_prefix(plane: str, servers: list[Server]) -> None:
    # Two prefill instances computed different lengths of the same conversation.
    short = Server(seed=3, count=4)
    long = Server(seed=3, count=10)
    servers += [short, long]
    result = run(procs.decode_pull, [short.endpoint, long.endpoint], 3, 10, plane, {})
    assert result["prefix"] == 10
    assert result["matches"] == 10
    short_stats, long_stats = short.stop(), long.stop()
    assert long_stats is not None and long_stats["counts"]["chunks_hit"] == 10
    assert short_stats is not None and short_stats["counts"].get("chunks_hit", 0) == 0


def test_offload_goes_to_the_peer_with_spare_capacity(plane: str, servers: list[Server]) -> None:
    # Both peers are host caches of 16 slots; one is already half full.
    busy = Server(seed=1, count=8, store_kind="host", capacity_chunks=16)
    idle = Server(seed=0, count=0, store_kind="host", capacity_chunks=16)
    servers += [busy, idle]
    result = run(procs.offload_push, [busy.endpoint, idle.endpoint], 5, 6, plane, {})
    assert result["target"] == idle.endpoint
    assert result["stored"] == [True] * 6
    expected = sorted(c.key.hex for c in procs.chunks_for(5, 6))
    assert idle.ask("keys") == expected
    assert not set(expected) & set(busy.ask("keys"))
    # and a decode instance can now pull the offloaded chunks from there
    pulled = run(procs.decode_pull, [busy.endpoint, idle.endpoint], 5, 6, plane, {})
    assert pulled["prefix"] == 6 and pulled["matches"] == 6


def test_authenticated_pull_between_processes(plane: str, servers: list[Server]) -> None:
    prefill = Server(seed=9, count=5, secret="s3cret")
    servers.append(prefill)
    ok = run(procs.decode_pull, [prefill.endpoint], 9, 5, plane, {"secret": "s3cret"})
    assert ok["prefix"] == 5 and ok["matches"] == 5
    wrong = run(procs.decode_pull, [prefill.endpoint], 9, 5, plane, {"secret": "guess"})
    assert wrong["prefix"] == 0 and wrong["matches"] == 0
    stats = prefill.stop()
    assert stats is not None and stats["counts"].get("rejected_auth_failed", 0) >= 1
