"""Choosing the host policy: HostCache, ``serve --policy``, the connector's ``host_policy``;
and the chain parents a chain-following policy gets from chunk headers."""

from __future__ import annotations

import pytest

from chunkstore.cache import DEFAULT_POLICY, POLICY_NAMES, HostCache, PrefixARCPolicy
from chunkstore.cache._chains import chunk_parent
from chunkstore.cli.main import build_parser
from chunkstore.format import ChunkLayout
from chunkstore.hashing import ChunkKey
from chunkstore.testing.factories import MadeChunk
from chunkstore.vllm.config import parse_config


def test_every_name_selects_its_policy_everywhere(layout: ChunkLayout) -> None:
    assert DEFAULT_POLICY == "parc" and POLICY_NAMES == ("parc", "arc", "lru")
    for name in POLICY_NAMES:
        with HostCache(layout, num_slots=2, policy=name) as cache:
            assert cache.policy_name == name
        args = build_parser().parse_args(
            ["serve", "--slot-size", "4KiB", "--host-cache", "64KiB", "--policy", name]
        )
        assert args.policy == name
        assert parse_config({"host_policy": name.upper()}, block_size=16).host_policy == name
    assert parse_config({}, block_size=16).host_policy == DEFAULT_POLICY
    assert build_parser().parse_args(["serve", "--slot-size", "4KiB"]).policy == DEFAULT_POLICY
    with HostCache(layout, num_slots=2) as cache:
        assert cache.policy_name == DEFAULT_POLICY


def test_chunk_parent_reads_the_header(chain: list[MadeChunk]) -> None:
    # The first chunk's parent is the namespace root: no chunk, no parent.
    assert chunk_parent(chain[0].key, chain[0].data) is None
    assert chunk_parent(chain[1].key, chain[1].data) == chain[0].key
    assert chunk_parent(chain[5].key, memoryview(chain[5].data)) == chain[4].key
    # Foreign bytes and a header that names another key give nothing.
    assert chunk_parent(chain[1].key, b"not a chunk at all") is None
    assert chunk_parent(chain[2].key, chain[1].data) is None
    assert chunk_parent(ChunkKey(bytes(32), chain[1].key.namespace), b"") is None


@pytest.mark.parametrize("write", ["put", "reserve"])
def test_host_cache_tells_parc_each_chunks_parent(
    layout: ChunkLayout, chain: list[MadeChunk], write: str
) -> None:
    policy = PrefixARCPolicy(4)
    with HostCache(layout, num_slots=4, policy=policy) as cache:
        for made in chain[:3]:
            if write == "put":
                assert cache.put(made.key, made.data)
            else:
                lease = cache.reserve(made.key)
                assert lease is not None
                lease.view[: len(made.data)] = made.data
                cache.commit(lease, len(made.data))
        assert policy.parent_of(chain[0].key) is None
        assert policy.parent_of(chain[1].key) == chain[0].key
        assert policy.children_of(chain[1].key) == {chain[2].key}
        # Arbitrary bytes are cached as before, with no parent.
        other = ChunkKey(b"\x07" * 32, chain[0].key.namespace)
        assert cache.put(other, b"opaque")
        assert policy.parent_of(other) is None
