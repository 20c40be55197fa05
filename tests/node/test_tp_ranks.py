"""TP ranks through the node service: each rank process writes its heads into one shared slot."""

from __future__ import annotations

from chunkstore.node import NodeClient, NodeStore
from chunkstore.testing.factories import sample_chunks
from tests.node.conftest import SLOT_SIZE, Child, Node, quiet, spawn, wait_until


def test_two_rank_processes_make_one_chunk_identical_to_a_whole_one(sealing_node: Node) -> None:
    node = sealing_node
    rank0 = spawn("rank-stay", node.socket, "12", "3", "engine-r0", "0", "2")
    assert rank0.line() == "committed 3"  # its parts are in; nothing is published yet
    keys = [c.key for c in sample_chunks(3, seed=12)]
    assert not any(node.store.exists_many(keys))
    rank1 = spawn("rank", node.socket, "12", "3", "engine-r1", "1", "2")
    assert rank1.line() == "committed 3"
    assert_serves_whole_chunks(node, 12, 3, rank0)


def assert_serves_whole_chunks(node: Node, seed: int, count: int, *ranks: Child) -> None:
    """The node serves the ``count`` chunks of ``seed`` byte for byte as whole ones; then the
    ``ranks`` still running stop, and every pin and reservation goes."""
    store = NodeStore(NodeClient(node.socket, slot_size=SLOT_SIZE))
    try:
        keys = [c.key for c in sample_chunks(count, seed=seed)]
        assert store.get_many(keys) == [c.data for c in sample_chunks(count, seed=seed)]
    finally:
        store.close()
        for rank in ranks:
            rank.stop()
    wait_until(lambda: quiet(node), "every pin and reservation to be released")


def test_ranks_of_two_engines_never_make_one_chunk_together(sealing_node: Node) -> None:
    node = sealing_node
    keys = [c.key for c in sample_chunks(2, seed=16)]
    # Engine A's rank 0 and engine B's rank 1 reserve the same chunks: two halves from
    # two engines must not make a chunk (each engine assembles its own).
    a0 = spawn("rank-stay", node.socket, "16", "2", "a-r0", "0", "2", "engine-a")
    assert a0.line() == "committed 2"
    b1 = spawn("rank-stay", node.socket, "16", "2", "b-r1", "1", "2", "engine-b")
    assert b1.line() == "committed 2"
    assert not any(node.store.exists_many(keys))
    # Engine A's own last rank completes its chunks; B's rank 0 then finds them held (B's
    # half-made copies go when B's rank 1 ends).
    a1 = spawn("rank", node.socket, "16", "2", "a-r1", "1", "2", "engine-a")
    assert a1.line() == "committed 2"
    assert all(node.store.exists_many(keys))
    b0 = spawn("rank", node.socket, "16", "2", "b-r0", "0", "2", "engine-b")
    assert b0.line() == "committed 0"
    assert_serves_whole_chunks(node, 16, 2, a0, b1)


def test_a_rank_killed_before_its_part_takes_the_chunk_down_and_leaks_nothing(
    sealing_node: Node,
) -> None:
    node = sealing_node
    holder = spawn("hold-rank", node.socket, "13", "2", "engine-r1", "1", "2")
    assert holder.line() == "ready 2"
    holder.kill()
    wait_until(lambda: quiet(node), "the killed rank's reservations to be given up")
    # A rank whose partner never comes: when it exits, its half-made chunks go too.
    lonely = spawn("rank", node.socket, "13", "2", "engine-r0", "0", "2")
    assert lonely.line() == "committed 2"
    assert lonely.proc.wait() == 0
    wait_until(lambda: quiet(node), "the lonely rank's chunks to be given up")
    assert not any(node.store.exists_many([c.key for c in sample_chunks(2, seed=13)]))


def test_a_node_without_the_model_layout_refuses_tp_parts(node: Node) -> None:
    assert spawn("rank", node.socket, "14", "1", "engine-r0", "0", "2").line() == "committed 0"
