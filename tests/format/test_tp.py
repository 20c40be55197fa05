"""Layout independence: any TP split, written in any order, assembles into identical chunk bytes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkstore.errors import ConfigError
from chunkstore.format import (
    MLA,
    ChunkLayout,
    KVSpec,
    LayerGroup,
    encode_chunk,
    key_digest,
    rank_share,
    seal_chunk,
)
from chunkstore.hashing import namespace_of, namespace_root
from tests.format.strategies import kv_specs, random_tensors


def _shard(tensors: dict[str, np.ndarray], layout: ChunkLayout, rank: int, tp: int) -> dict:
    """What rank `rank` of `tp` holds on its device (its heads; unsplit tensors whole)."""
    return layout.shard_of(tensors, rank, tp)


def _assemble(layout, tensors, tokens, root, tp, order) -> bytes:
    buf = bytearray(layout.total_size)
    for rank in order:
        layout.write_shard(buf, rank, tp, _shard(tensors, layout, rank, tp))
    seal_chunk(
        layout,
        buf,
        key=key_digest(root, tokens),
        parent=root,
        namespace=namespace_of(root),
        tokens=tokens,
    )
    return bytes(buf)


def _valid_tps(spec: KVSpec) -> list[int]:
    heads = [g.num_kv_heads for g in spec.groups if g.kind not in (MLA, "state")]
    tps = []
    for tp in (1, 2, 4, 8):
        if all(h % tp == 0 or tp % h == 0 for h in heads):
            tps.append(tp)
    return tps


@given(kv_specs(), st.integers(0, 2**31), st.randoms(use_true_random=False))
def test_every_tp_size_and_write_order_gives_identical_bytes(spec, seed, rnd) -> None:
    layout = ChunkLayout(spec)
    tensors = random_tensors(layout, seed)
    tokens = np.arange(spec.chunk_tokens, dtype=np.uint32) * 3
    root = namespace_root(layout.fingerprint)
    reference = bytes(
        encode_chunk(
            layout,
            key=key_digest(root, tokens),
            parent=root,
            namespace=namespace_of(root),
            tokens=tokens,
            tensors=tensors,
        )
    )
    for tp in _valid_tps(spec):
        order = list(range(tp))
        rnd.shuffle(order)
        assert _assemble(layout, tensors, tokens, root, tp, order) == reference, (tp, order)


@given(kv_specs(), st.integers(0, 2**31))
def test_read_shard_returns_what_the_rank_wrote(spec, seed) -> None:
    layout = ChunkLayout(spec)
    tensors = random_tensors(layout, seed)
    for tp in _valid_tps(spec):
        buf = bytearray(layout.total_size)
        for rank in range(tp):
            layout.write_shard(buf, rank, tp, _shard(tensors, layout, rank, tp))
        for rank in range(tp):
            got = layout.read_shard(buf, rank, tp)
            want = _shard(tensors, layout, rank, tp)
            assert {k: v.tobytes() for k, v in got.items()} == {
                k: v.tobytes() for k, v in want.items()
            }


@given(kv_specs(), st.integers(0, 2**31))
def test_rank_ranges_cover_exactly_the_rank_bytes(spec, seed) -> None:
    layout = ChunkLayout(spec)
    tensors = random_tensors(layout, seed)
    for tp in _valid_tps(spec):
        for rank in range(tp):
            buf = bytearray(layout.total_size)
            layout.write_shard(buf, rank, tp, _shard(tensors, layout, rank, tp))
            mask = np.zeros(layout.total_size, dtype=bool)
            for r in layout.rank_ranges(rank, tp, for_write=True):
                mask[r.offset : r.offset + r.length] = True
            # every byte outside the write ranges is untouched; inside, it is the data
            assert not np.frombuffer(buf, np.uint8)[~mask].any()
            read_ranges = layout.rank_ranges(rank, tp)
            assert len(read_ranges) <= 2 * spec.num_layers
            covered = sum(r.length for r in read_ranges)
            expected = sum(v.nbytes for v in _shard(tensors, layout, rank, tp).values())
            assert covered == expected


def test_shard_of_slices_heads_without_copying() -> None:
    layout = ChunkLayout(
        KVSpec.simple("m", num_layers=1, num_kv_heads=4, head_dim=2, chunk_tokens=2)
    )
    tensors = random_tensors(layout, 3)
    shard = layout.shard_of(tensors, 1, 2)
    assert shard["layers.0.k"].tobytes() == tensors["layers.0.k"][2:4].tobytes()
    assert np.shares_memory(shard["layers.0.v"], tensors["layers.0.v"])
    assert shard["layers.0.k"].shape == (2, 2, 2)


def test_tp1_share_is_the_whole_payload_in_one_range() -> None:
    layout = ChunkLayout(
        KVSpec.simple("m", num_layers=4, num_kv_heads=8, head_dim=16, chunk_tokens=8)
    )
    assert [(r.offset, r.length) for r in layout.rank_ranges(0, 1)] == [
        (layout.data_offset, layout.payload_size)
    ]
    assert len(layout.rank_ranges(1, 4)) == 2 * 4  # K and V of each layer


def test_replicated_heads_when_tp_exceeds_kv_heads() -> None:
    assert rank_share(0, 4, 2) == rank_share(0, 4, 2)
    shares = [rank_share(r, 4, 2) for r in range(4)]
    assert [(s.start, s.stop, s.writer) for s in shares] == [
        (0, 1, True),
        (0, 1, False),
        (1, 2, True),
        (1, 2, False),
    ]
    with pytest.raises(ConfigError):
        rank_share(0, 3, 2)
    with pytest.raises(ConfigError):
        rank_share(4, 4, 2)


def test_mla_latent_is_not_split_and_written_by_rank_zero_only() -> None:
    spec = KVSpec("ds", "BF16", 8, (LayerGroup(MLA, (0, 1), 1, 16),))
    layout = ChunkLayout(spec)
    assert layout.rank_ranges(3, 4, for_write=True) == []
    assert layout.rank_ranges(3, 4) == layout.rank_ranges(0, 1)
    tensors = random_tensors(layout, 1)
    buf = bytearray(layout.total_size)
    for rank, tp in itertools.product(range(4), [4]):
        layout.write_shard(buf, rank, tp, tensors)
    assert (
        layout.tensor_view(buf, "layers.1.latent").tobytes() == tensors["layers.1.latent"].tobytes()
    )
