"""The connector option ``node``: parsing, and the connector store's refusals and saves."""

from __future__ import annotations

import pytest

from chunkstore.errors import ConfigError
from chunkstore.format import ChunkLayout
from chunkstore.node import NodeRefused
from chunkstore.testing.factories import sample_chunks, small_spec
from chunkstore.vllm.config import parse_config
from chunkstore.vllm.metadata import ChunkSave
from tests.node.conftest import Node


def test_node_takes_a_unix_socket_path() -> None:
    for value in ("unix:///run/chunkstore/node.sock", "/run/chunkstore/node.sock"):
        cfg = parse_config({"node": value}, block_size=16)
        assert cfg.node == "ipc:///run/chunkstore/node.sock"
    assert parse_config({}, block_size=16).node is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("tcp://127.0.0.1:5555", "unix:///path"),
        ("unix://relative/node.sock", "absolute"),
        ("/" + "n" * 200, "longer than"),
        (42, "unix:///path"),
    ],
)
def test_a_bad_node_is_one_line_naming_the_option(value: object, says: str) -> None:
    with pytest.raises(ConfigError) as bad:
        parse_config({"node": value}, block_size=16)
    message = str(bad.value)
    assert message.startswith("node: ") and says in message and "\n" not in message


def test_tiers_belong_to_the_node_service() -> None:
    with pytest.raises(ConfigError, match="chunkstore serve --store"):
        parse_config({"node": "/run/n.sock", "tiers": "file:///mnt/kv"}, block_size=16)


def test_an_engine_with_another_chunk_size_is_refused(node: Node) -> None:
    from chunkstore.node import NodeCache

    other = ChunkLayout(small_spec(chunk_tokens=32))
    with pytest.raises(NodeRefused, match="slots"):
        NodeCache(node.socket, layout=other)


def test_a_save_through_the_connector_store_is_published_and_read_in_place(node: Node) -> None:
    from chunkstore.node import NodeCache

    layout = ChunkLayout(small_spec())
    chunk = sample_chunks(1, seed=4, layout=layout)[0]
    store = NodeCache(node.socket, layout=layout, client_name="engine")
    try:
        save = ChunkSave("r", chunk.key, chunk.parent, tuple(int(t) for t in chunk.tokens), ())
        slot = store.save_slot(save)
        assert slot is not None
        slot.view[layout.data_offset : layout.total_size] = chunk.data[layout.data_offset :]
        store.save_done(save, slot)
        assert store.host_run([chunk.key]) == 1 and store.host.contains(chunk.key)
        with store.read_host(chunk.key) as view:
            assert bytes(view) == chunk.data
        assert store.save_slot(save) is None  # held already: nothing to write
    finally:
        store.close()


def test_tp_ranks_save_their_heads_into_one_slot_and_the_engine_reads_it_whole(
    sealing_node: Node,
) -> None:
    from chunkstore.node import NodeCache, NodeRankCache

    layout = ChunkLayout(small_spec())
    chunk = sample_chunks(1, seed=15, layout=layout)[0]
    save = ChunkSave("r", chunk.key, chunk.parent, tuple(int(t) for t in chunk.tokens), ())
    ranks = [
        NodeRankCache(
            sealing_node.socket, layout=layout, rank=r, tp=2, engine="e", client_name=f"r{r}"
        )
        for r in range(2)
    ]
    engine = NodeCache(sealing_node.socket, layout=layout, client_name="scheduler")
    try:
        for rank, store in enumerate(ranks):
            slot = store.save_slot(save)
            assert slot is not None
            for part in layout.rank_ranges(rank, 2, for_write=True):
                end = part.offset + part.length
                slot.view[part.offset : end] = chunk.data[part.offset : end]
            assert engine.host_run([chunk.key]) == 0  # not whole before the last part
            store.save_done(save, slot)
        assert engine.host_run([chunk.key]) == 1
        with ranks[1].read_host(chunk.key) as view:
            assert bytes(view) == chunk.data
    finally:
        for store in (*ranks, engine):
            store.close()
