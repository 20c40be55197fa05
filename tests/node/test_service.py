"""The node service with simulated engine processes: sharing, crash clean-up, refusals."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from chunkstore.cache._pool import READY, WRITING
from chunkstore.node import NodeClient, NodeRefused
from chunkstore.testing.factories import sample_chunks
from tests.node.conftest import SLOT_SIZE, Node, quiet, spawn, start_node, states, wait_until


def test_a_saves_b_hits_from_host_memory_with_zero_tier_reads(node: Node) -> None:
    saver = spawn("save", node.socket, "7", "3", "engine-a")
    assert saver.line() == "saved 3"
    assert saver.proc.wait() == 0
    node.store.flush()  # the write-behind reached the tier; reads must still not touch it
    before = node.store.stats().tiers[0]
    getter = spawn("get", node.socket, "7", "3", "engine-b")
    assert getter.line() == "matched 3"
    assert getter.proc.wait() == 0
    after = node.store.stats().tiers[0]
    assert (after.hits, after.misses) == (before.hits, before.misses)
    assert states(node, READY) == 3  # one copy in host memory, shared by both engines
    hits = node.metrics.registry.get_sample_value(
        "chunkstore_node_client_chunks_total",
        {"server": "node", "client": "engine-b", "result": "hit"},
    )
    assert hits == 3
    wait_until(lambda: quiet(node), "the engines' leases to be released")


def test_a_killed_engine_leaves_no_leased_slot(node: Node) -> None:
    assert spawn("save", node.socket, "3", "4").line() == "saved 4"
    holder = spawn("hold-lease", node.socket, "3", "4", "holder")
    assert holder.line() == "ready 4"
    assert node.host.pool.pinned_slots() == 4
    leases = node.metrics.registry.get_sample_value(
        "chunkstore_node_client_leases", {"server": "node", "client": "holder"}
    )
    assert leases == 1
    holder.kill()
    wait_until(lambda: quiet(node), "the killed engine's pins to be released")
    assert states(node, READY) == 4  # the chunks themselves stay cached


def test_an_engine_killed_mid_save_leaves_no_half_written_slot(node: Node) -> None:
    assert spawn("save", node.socket, "8", "2", "other").line() == "saved 2"
    writer = spawn("hold-reservation", node.socket, "5", "3", "writer")
    assert writer.line() == "ready 3"
    assert states(node, WRITING) == 3
    writer.kill()
    wait_until(lambda: quiet(node), "the killed engine's reservations to be aborted")
    assert states(node, READY) == 2  # only the other engine's chunks
    assert not any(node.store.exists_many([c.key for c in sample_chunks(3, seed=5)]))
    assert spawn("get", node.socket, "8", "2", "other").line() == "matched 2"  # unaffected
    # The slots are usable again: a save that needs every other slot still fits.
    assert spawn("save", node.socket, "6", "14").line() == "saved 14"


def test_a_chunk_that_fails_its_check_is_never_published(node: Node) -> None:
    chunk = sample_chunks(1, seed=9)[0]
    client = NodeClient(node.socket, slot_size=SLOT_SIZE)
    try:
        reservation = client.reserve([chunk.key])
        view = reservation.views[0]
        assert view is not None
        damaged = bytearray(chunk.data)
        damaged[-1] ^= 0xFF
        view[: len(damaged)] = damaged
        assert client.commit(reservation, [len(damaged)]) == [False]
        assert not node.store.exists(chunk.key)
        assert quiet(node)
    finally:
        client.close()


def test_mismatched_chunk_size_is_refused_naming_both_sides(node: Node) -> None:
    client = NodeClient(node.socket, slot_size=SLOT_SIZE + 4096)
    with pytest.raises(NodeRefused) as refused:
        client.attach()
    message = str(refused.value)
    assert "\n" not in message
    assert f"{SLOT_SIZE}-byte slots" in message and f"{SLOT_SIZE + 4096} bytes" in message
    client.close()


def test_other_model_is_refused_naming_both_sides(tmp_path: Path) -> None:
    served = start_node(tmp_path, fingerprint=b"\x01" * 32)
    client = NodeClient(served.socket, slot_size=SLOT_SIZE, fingerprint=b"\x02" * 32)
    try:
        with pytest.raises(NodeRefused) as refused:
            client.attach()
        assert "0101010101" in str(refused.value) and "0202020202" in str(refused.value)
    finally:
        client.close()
        served.server.stop()
        served.store.close()


def test_a_wrong_or_missing_secret_is_refused(tmp_path: Path) -> None:
    served = start_node(tmp_path, secret=b"node secret")
    try:
        for secret in (b"another secret", None):
            client = NodeClient(served.socket, slot_size=SLOT_SIZE, secret=secret)
            with pytest.raises(NodeRefused, match="auth"):
                client.attach()
            client.close()
        good = NodeClient(served.socket, slot_size=SLOT_SIZE, secret=b"node secret")
        assert good.attach()
        good.close()
    finally:
        served.server.stop()
        served.store.close()


def test_the_socket_is_owner_only_and_a_live_one_is_not_taken_over(
    node: Node, tmp_path: Path
) -> None:
    mode = os.stat(node.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    from chunkstore.errors import ConfigError
    from chunkstore.node import NodeServer

    with pytest.raises(ConfigError, match="another node service"):
        NodeServer(node.store, bind=f"ipc://{node.socket}", planes=("shm",)).start()
    assert stat.S_ISSOCK(os.stat(node.socket).st_mode)  # still the live service's


def test_only_the_node_server_lends_slots_over_the_shm_plane(node: Node, tmp_path: Path) -> None:
    """The ``shm`` plane is the node service's: a plain peer server over the same shared
    pool does not offer it, and says which server does."""
    from chunkstore.errors import ConfigError
    from chunkstore.peer import PeerServer

    plain = PeerServer(
        node.store, bind=f"ipc://{tmp_path / 'plain.sock'}", planes=("shm",), use_env_secret=False
    )
    with pytest.raises(ConfigError, match=r"no data plane left.*chunkstore\.node\.NodeServer"):
        plain.start()
    assert plain.shm_reason is not None and "node service" in plain.shm_reason
    assert node.server.planes == ("shm",) and node.server.shm_reason is None


def test_engines_attached_are_counted(node: Node) -> None:
    clients = [NodeClient(node.socket, slot_size=SLOT_SIZE, client_name=n) for n in "xy"]
    for client in clients:
        assert client.attach()
    gauge = node.metrics.registry.get_sample_value
    assert gauge("chunkstore_node_clients", {"server": "node"}) == 2
    for client in clients:
        client.close()
    wait_until(
        lambda: gauge("chunkstore_node_clients", {"server": "node"}) == 0, "engines to detach"
    )
