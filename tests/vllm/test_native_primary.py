"""PrimaryLayout: vLLM 0.33 primary-tier slots <-> canonical chunk payloads (no vLLM needed).

A slot holds each TP worker's pages of every layer (LBNHC or LBHNC pages); whatever the TP
size and page order, the chunk payload is the same canonical bytes, and loading writes every
rank's heads back.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from chunkstore.errors import ConfigError  # noqa: E402
from chunkstore.format import (  # noqa: E402
    ATTENTION,
    ChunkLayout,
    KVSpec,
    LayerGroup,
    rank_share,  # noqa: E402
)
from chunkstore.vllm.engine import EngineKV, LayerInfo  # noqa: E402
from chunkstore.vllm.native.primary import PrimaryLayout  # noqa: E402

HEADS, DIM, BLOCK, BPC, LAYERS = 4, 32, 16, 2, 3
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def engine(heads: int = HEADS, dim: int = DIM) -> EngineKV:
    spec = KVSpec(
        model_id="m",
        dtype="BF16",
        chunk_tokens=BLOCK * BPC,
        groups=(LayerGroup(ATTENTION, tuple(range(LAYERS)), heads, dim),),
    )
    layers = {n: LayerInfo(n, i, 0, ATTENTION, 0, heads, dim, True) for i, n in enumerate(NAMES)}
    return EngineKV(spec, ChunkLayout(spec), layers, BLOCK, 0, 1, 1, None)


def canonical(
    seed: int = 0, heads: int = HEADS, dim: int = DIM
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (heads, BLOCK * BPC, dim)
    return [
        (
            torch.randn(shape, generator=g).to(torch.bfloat16),
            torch.randn(shape, generator=g).to(torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]


def slot(kv: list[tuple[torch.Tensor, torch.Tensor]], tp: int, order: str) -> torch.Tensor:
    """A slot as vLLM's workers fill it, built element by element from canonical K/V."""
    parts = []
    heads, dim = kv[0][0].shape[0], kv[0][0].shape[-1]
    for rank in range(tp):
        share = rank_share(rank, tp, heads)
        for k, v in kv:
            page = torch.cat((k, v), dim=-1)[share.start : share.stop]  # [h, T, 2D]
            page = page.view(-1, BPC, BLOCK, 2 * dim)  # [h, blocks, N, 2D]
            if order == "LBNHC":
                page = page.permute(1, 2, 0, 3)  # [blocks, N, h, 2D]
            else:
                page = page.permute(1, 0, 2, 3)  # [blocks, h, N, 2D]
            parts.append(page.contiguous().view(torch.uint8).reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize(
    ("heads", "dim"),
    [
        (HEADS, DIM),
        (8, 128),  # token rows of 8 x 2 x 128 bf16 = 4 KiB: LBNHC slots are gathered by block
    ],
)
@pytest.mark.parametrize("order", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_tp_size_and_page_order_gives_the_same_payload_and_loads_back(tp, order, heads, dim):
    kv = canonical(heads=heads, dim=dim)
    eng = engine(heads, dim)
    data = slot(kv, tp, order)
    primary = PrimaryLayout(
        eng,
        tp_size=tp,
        blocks_per_chunk=BPC,
        kv_cache_layout=order,
        layer_order=NAMES,
        slot_bytes=data.numel() + 4096,  # vLLM pads slots
    )
    padded = torch.cat((data, torch.zeros(4096, dtype=torch.uint8)))
    chunk = bytearray(eng.layout.total_size)
    payload = memoryview(chunk)[eng.layout.data_offset :]
    primary.to_payload(memoryview(padded.numpy()), payload)
    for i, (k, v) in enumerate(kv):
        got_k = eng.layout.tensor_view(chunk, f"layers.{i}.k")
        got_v = eng.layout.tensor_view(chunk, f"layers.{i}.v")
        assert got_k.tobytes() == k.contiguous().view(torch.uint8).numpy().tobytes()
        assert got_v.tobytes() == v.contiguous().view(torch.uint8).numpy().tobytes()

    back = torch.zeros_like(padded)
    primary.from_payload(bytes(payload), memoryview(back.numpy()))
    assert torch.equal(back, padded)


def test_a_slot_too_small_for_the_engine_fails_at_start_up():
    with pytest.raises(ConfigError, match="not laid out as the chunkstore tier expects"):
        PrimaryLayout(
            engine(),
            tp_size=1,
            blocks_per_chunk=BPC,
            kv_cache_layout="LBNHC",
            layer_order=NAMES,
            slot_bytes=1024,
        )


def test_unknown_page_order_names_itself():
    with pytest.raises(ConfigError, match="BLNHC"):
        PrimaryLayout(
            engine(),
            tp_size=1,
            blocks_per_chunk=BPC,
            kv_cache_layout="BLNHC",
            layer_order=NAMES,
            slot_bytes=1 << 20,
        )
