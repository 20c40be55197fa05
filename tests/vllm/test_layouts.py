"""Device page layouts <-> canonical [heads, tokens, dim] tensors, on CPU tensors.

Each layout is checked against an element-by-element reference packing written
from the kernel's indexing formula (not from the class under test), and the
CPU ``vec`` layout also against vLLM's own ``cpu_attn_reshape_and_cache`` op.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from chunkstore.errors import ConfigError  # noqa: E402
from chunkstore.vllm.layouts import (  # noqa: E402
    CpuAmxLayout,
    CpuVecLayout,
    FlashAttnLayout,
    FlashInferHNDLayout,
    FlashInferNHDLayout,
    MLALayout,
    detect_layout,
)

H, D, N, B = 2, 32, 32, 6
BLOCKS = [4, 1, 3]


def canonical(seed: int = 0, heads: int = H, dim: int = D, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    t = len(BLOCKS) * N
    k = torch.randn(heads, t, dim, generator=g).to(dtype)
    v = torch.randn(heads, t, dim, generator=g).to(dtype)
    return k, v


def ref_cpu_vec(k, v):
    kv = torch.zeros(B, H, N, 2 * D, dtype=k.dtype)
    page = kv.view(B, H, 2 * N * D)
    for i, b in enumerate(BLOCKS):
        for h in range(H):
            for t in range(N):
                for d in range(D):
                    page[b, h, d * N + t] = k[h, i * N + t, d]  # K column-major [D, N]
                    page[b, h, N * D + t * D + d] = v[h, i * N + t, d]  # V row-major [N, D]
    return kv


def ref_cpu_amx(k, v):
    kv = torch.zeros(B, H, N, 2 * D, dtype=k.dtype)
    page = kv.view(B, H, 2 * N * D)
    for i, b in enumerate(BLOCKS):
        for h in range(H):
            for t in range(N):
                for d in range(D):
                    # K: 32-bit words of two dims, 16 tokens per group
                    word = (t // 16) * (D // 2) * 16 + (d // 2) * 16 + t % 16
                    page[b, h, word * 2 + d % 2] = k[h, i * N + t, d]
                    # V: pairs of tokens, groups of 16 dims
                    idx = (d // 16) * N * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
                    page[b, h, N * D + idx] = v[h, i * N + t, d]
    return kv


def ref_paged(k, v, order):
    """Physical tensor in ``order`` (of logical dims B,H,N,C), returned as the logical view."""
    logical = torch.zeros(B, H, N, 2 * D, dtype=k.dtype)
    for i, b in enumerate(BLOCKS):
        for t in range(N):
            logical[b, :, t, :D] = k[:, i * N + t]
            logical[b, :, t, D:] = v[:, i * N + t]
    physical = logical.permute(*order).contiguous()
    inverse = [order.index(i) for i in range(4)]
    return physical.permute(*inverse)


CASES = [
    (CpuVecLayout, ref_cpu_vec),
    (CpuAmxLayout, ref_cpu_amx),
    (FlashAttnLayout, lambda k, v: ref_paged(k, v, (0, 2, 1, 3))),
    (FlashInferNHDLayout, lambda k, v: ref_paged(k, v, (0, 2, 1, 3))),
    (FlashInferHNDLayout, lambda k, v: ref_paged(k, v, (0, 1, 2, 3))),
]


@pytest.mark.parametrize(("cls", "ref"), CASES, ids=[c[0].name for c in CASES])
def test_gather_matches_reference_packing(cls, ref):
    k, v = canonical()
    kv = ref(k, v)
    layout = cls(num_heads=H, head_dim=D, block_size=N)
    layout.check(kv)
    gk, gv = layout.gather(kv, torch.tensor(BLOCKS))
    assert torch.equal(gk, k)
    assert torch.equal(gv, v)


@pytest.mark.parametrize(("cls", "ref"), CASES, ids=[c[0].name for c in CASES])
def test_scatter_matches_reference_packing(cls, ref):
    k, v = canonical(1)
    expected = ref(k, v)
    kv = torch.zeros_like(expected)  # same strides as the reference
    layout = cls(num_heads=H, head_dim=D, block_size=N)
    layout.scatter(kv, torch.tensor(BLOCKS), k, v)
    assert torch.equal(kv, expected)
    untouched = [b for b in range(B) if b not in BLOCKS]
    assert not kv[untouched].any()


@pytest.mark.parametrize(("cls", "ref"), CASES, ids=[c[0].name for c in CASES])
def test_block_ranges_agree_with_gather_and_scatter(cls, ref):
    """gather_range/scatter_range (a run of consecutive blocks, as the native tier reads vLLM's
    primary slots) give what gather/scatter give for the same blocks."""
    k, v = canonical(3)
    kv = ref(k, v)
    layout = cls(num_heads=H, head_dim=D, block_size=N)
    first, count = 1, 3
    blocks = torch.arange(first, first + count)
    want_k, want_v = layout.gather(kv, blocks)
    got_k, got_v = torch.empty_like(want_k), torch.empty_like(want_v)
    layout.gather_range(kv, first, count, got_k, got_v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)

    expected, mine = torch.zeros_like(kv), torch.zeros_like(kv)
    layout.scatter(expected, blocks, want_k, want_v)
    layout.scatter_range(mine, first, count, want_k, want_v)
    assert torch.equal(mine, expected)


def test_mla_round_trip():
    latent = torch.randn(len(BLOCKS) * N, 48).to(torch.bfloat16)
    kv = torch.zeros(B, 1, N, 48, dtype=torch.bfloat16)
    layout = MLALayout(num_heads=1, head_dim=48, block_size=N)
    layout.check(kv)
    layout.scatter(kv, torch.tensor(BLOCKS), latent, None)
    assert torch.equal(kv[BLOCKS[1], 0, 5], latent[N + 5])
    got, none = layout.gather(kv, torch.tensor(BLOCKS))
    assert none is None and torch.equal(got, latent)


def test_detect_by_backend_and_strides():
    k, v = canonical()
    hnd = ref_paged(k, v, (0, 1, 2, 3))
    nhd = ref_paged(k, v, (0, 2, 1, 3))
    args = {"num_heads": H, "head_dim": D, "block_size": N}
    assert detect_layout(hnd, backend="FLASHINFER", **args).name == "flashinfer_hnd"
    assert detect_layout(nhd, backend="FLASHINFER", **args).name == "flashinfer_nhd"
    assert detect_layout(nhd, backend="FLASH_ATTN", **args).name == "flash_attn"
    assert detect_layout(hnd, backend="CPU_ATTN", cpu_isa="vec", **args).name == "cpu_vec"
    assert detect_layout(hnd, backend="CPU_ATTN", cpu_isa="vec16", **args).name == "cpu_vec"
    assert detect_layout(hnd, backend="CPU_ATTN", cpu_isa="amx", **args).name == "cpu_amx"
    mla = torch.zeros(B, 1, N, 64)
    assert detect_layout(mla, mla=True, num_heads=1, head_dim=64, block_size=N).name == "mla"


def test_one_head_per_rank_is_recognised_whatever_its_stride():
    # 8 KV heads at TP=8: the head dim has size 1, so its stride says nothing about order.
    one = torch.zeros(B, N, 1, 2 * D).transpose(1, 2)
    args = {"num_heads": 1, "head_dim": D, "block_size": N}
    assert detect_layout(one, backend="FLASH_ATTN", **args).name == "flash_attn"
    assert detect_layout(one, backend="FLASHINFER", **args).name == "flashinfer_hnd"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"backend": "FLASH_ATTN", "num_heads": 3}, "unknown KV cache layout"),
        ({"backend": "CPU_ATTN", "cpu_isa": "neon"}, "neon"),
        ({"backend": "SOME_NEW_BACKEND"}, "SOME_NEW_BACKEND"),
        ({"backend": "FLASH_ATTN", "block_size": 16}, "unknown KV cache layout"),
    ],
)
def test_unknown_layouts_fail_clearly(kwargs, message):
    k, v = canonical()
    kv = ref_paged(k, v, (0, 2, 1, 3))
    args = {"num_heads": H, "head_dim": D, "block_size": N, **kwargs}
    with pytest.raises(ConfigError, match=message):
        detect_layout(kv, **args)


@pytest.mark.vllm_kernels
@pytest.mark.parametrize(
    ("isa", "block_size", "cls"),
    [("vec", N, CpuVecLayout), ("vec16", 16, CpuVecLayout), ("amx", N, CpuAmxLayout)],
)
def test_cpu_layouts_match_vllm_kernel(isa, block_size, cls):
    """vLLM's own CPU cache-write op produces exactly what the layout's scatter does, for the
    ``vec`` ISA, ``vec16`` (what vLLM picks at block size 16) and ``amx`` (AMX CPUs)."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if _get_attn_isa(torch.bfloat16, block_size, D) != isa:
        pytest.skip(f"this CPU does not use the {isa} attention ISA at block size {block_size}")
    k, v = canonical(2)
    tokens = len(BLOCKS) * block_size
    k, v = k[:, :tokens].contiguous(), v[:, :tokens].contiguous()
    kv = torch.zeros(B, H, block_size, 2 * D, dtype=torch.bfloat16)
    key_cache, value_cache = kv.view(B, H, 2 * block_size, D).chunk(2, dim=2)
    slots = torch.tensor(
        [b * block_size + t for b in BLOCKS for t in range(block_size)], dtype=torch.long
    )
    # the op takes [tokens, heads, dim]
    ops.cpu_attn_reshape_and_cache(
        k.permute(1, 0, 2).contiguous(),
        v.permute(1, 0, 2).contiguous(),
        key_cache,
        value_cache,
        slots,
        isa,
    )
    mine = torch.zeros_like(kv)
    layout = cls(num_heads=H, head_dim=D, block_size=block_size)
    layout.scatter(mine, torch.tensor(BLOCKS), k, v)
    assert torch.equal(mine, kv)
    detected = detect_layout(
        kv, num_heads=H, head_dim=D, block_size=block_size, backend="CPU_ATTN", cpu_isa=isa
    )
    assert detected.name == cls.name
