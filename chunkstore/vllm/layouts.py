"""Layout classes that convert device KV pages to and from canonical chunk tensors.

This module holds the only layout-specific code. vLLM hands one paged KV
tensor per attention layer to ``register_kv_caches``. A layout class knows how
that tensor stores one block's keys and values. It converts between the pages
and the format's canonical per-chunk tensors. Those are ``k`` and ``v`` as
``[heads, tokens, head_dim]``. For MLA, ``latent`` is ``[tokens, dim]``. The
heads are the rank's local heads. The caller places them at the rank's head
offset in the chunk.

A new layout is one small class with ``gather`` and ``scatter``. It also needs
an entry in :func:`detect_layout`. The code works on torch tensors and
block-id index tensors. So it runs on CPU tensors and GPU tensors alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from chunkstore.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "LAYOUTS",
    "CpuAmxLayout",
    "CpuVecLayout",
    "DeviceLayout",
    "FlashAttnLayout",
    "FlashInferHNDLayout",
    "FlashInferNHDLayout",
    "MLALayout",
    "PagedKVLayout",
    "detect_layout",
]


class DeviceLayout:
    """How one layer's paged KV tensor holds a block.

    Subclasses set ``name`` and implement :meth:`gather` and :meth:`scatter`.
    """

    name: ClassVar[str] = "abstract"
    has_values: ClassVar[bool] = True
    """Whether the layout has separate K and V; False for MLA's one latent per token."""

    def __init__(self, *, num_heads: int, head_dim: int, block_size: int) -> None:
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.block_size = block_size

    def check(self, kv: torch.Tensor) -> None:
        """Raise :class:`ConfigError` if ``kv`` does not have this layout's shape."""
        expected = self.expected_shape(kv.shape)
        if tuple(kv.shape) != expected:
            raise ConfigError(
                f"{self.name} layout expects a KV tensor shaped {expected}, got {tuple(kv.shape)}"
            )

    def expected_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The full tensor shape this layout expects, with the block count from ``shape``."""
        raise NotImplementedError

    def gather(
        self, kv: torch.Tensor, blocks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Canonical ``(k, v)`` for ``blocks``, in order.

        Each is ``[heads, len(blocks)*block_size, dim]``.

        For MLA ``k`` is the latent ``[tokens, dim]`` and ``v`` is None.
        """
        raise NotImplementedError

    def scatter(
        self, kv: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None
    ) -> None:
        """Write canonical ``k``/``v``, shaped as :meth:`gather` returns, into ``blocks``."""
        raise NotImplementedError

    def gather_range(
        self, kv: torch.Tensor, first: int, count: int, k_out: torch.Tensor, v_out: Any
    ) -> None:
        """Copy the canonical K/V of blocks ``first .. first+count`` into ``k_out``/``v_out``.

        The outputs are shaped as :meth:`gather` returns. Layouts override this
        to skip the temporaries.
        """
        import torch

        k, v = self.gather(kv, torch.arange(first, first + count, device=kv.device))
        k_out.copy_(k)
        if v is not None:
            v_out.copy_(v)

    def scatter_range(
        self, kv: torch.Tensor, first: int, count: int, k: torch.Tensor, v: Any
    ) -> None:
        """Write canonical ``k``/``v`` into blocks ``first .. first+count``."""
        import torch

        self.scatter(kv, torch.arange(first, first + count, device=kv.device), k, v)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(heads={self.num_heads}, head_dim={self.head_dim}, "
            f"block_size={self.block_size})"
        )


def _tokens(x: torch.Tensor, n_blocks: int, block_size: int) -> torch.Tensor:
    """``[H, n_blocks, N, D]`` -> ``[H, n_blocks*N, D]``."""
    return x.reshape(x.shape[0], n_blocks * block_size, x.shape[-1])


class CpuVecLayout(DeviceLayout):
    """vLLM CPU backend with the ``vec`` or ``vec16`` ISA: ``[B, H, N, 2*D]``.

    These ISAs serve AVX2 and AVX-512 CPUs.

    Each ``(block, head)`` page is K then V. K is stored transposed, as
    ``[D, N]``, because the kernel reads it column-major. V is ``[N, D]``.
    """

    name = "cpu_vec"

    def expected_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (shape[0], self.num_heads, self.block_size, 2 * self.head_dim)

    def _halves(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, h = pages.shape[0], pages.shape[1]
        flat = pages.reshape(n, h, 2, self.block_size * self.head_dim)
        k = flat[:, :, 0].reshape(n, h, self.head_dim, self.block_size)
        v = flat[:, :, 1].reshape(n, h, self.block_size, self.head_dim)
        return k, v

    def gather(self, kv: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._halves(kv.index_select(0, blocks))
        n = blocks.numel()
        k = _tokens(k.permute(1, 0, 3, 2), n, self.block_size)
        v = _tokens(v.permute(1, 0, 2, 3), n, self.block_size)
        return k, v

    def scatter(self, kv: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: Any) -> None:
        n, h, bs, d = blocks.numel(), self.num_heads, self.block_size, self.head_dim
        kp = k.reshape(h, n, bs, d).permute(1, 0, 3, 2).reshape(n, h, d * bs)
        vp = v.reshape(h, n, bs, d).permute(1, 0, 2, 3).reshape(n, h, bs * d)
        kv.index_copy_(0, blocks, torch_cat_last(kp, vp).reshape(n, h, bs, 2 * d))


class CpuAmxLayout(DeviceLayout):
    """vLLM CPU backend with the ``amx`` ISA for bf16: ``[B, H, N, 2*D]``.

    Each page is K then V. K holds pairs of head dims as 32-bit words. They
    come in groups of 16 tokens: ``K[t, d] = Kpage[t//16, d//2, t%16, d%2]``.
    V holds pairs of tokens per group of 16 head dims:
    ``V[t, d] = Vpage[d//16, t//2, d%16, t%2]``. The source is
    csrc/cpu/cpu_attn_amx.hpp. tests/vllm/test_layouts.py checks this against
    vLLM's own cache-write op on an AMX CPU.
    """

    name = "cpu_amx"

    def expected_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        if self.block_size % 32 or self.head_dim % 32:
            raise ConfigError("cpu_amx layout needs block_size and head_dim multiples of 32")
        return (shape[0], self.num_heads, self.block_size, 2 * self.head_dim)

    def gather(self, kv: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = kv.index_select(0, blocks)
        n, h, bs, d = pages.shape[0], self.num_heads, self.block_size, self.head_dim
        flat = pages.reshape(n, h, 2, bs * d)
        # K: [n, h, N/16, D/2, 16, 2] -> [h, n, N/16, 16, D/2, 2]
        k = flat[:, :, 0].reshape(n, h, bs // 16, d // 2, 16, 2).permute(1, 0, 2, 4, 3, 5)
        # V: [n, h, D/16, N/2, 16, 2] -> [h, n, N/2, 2, D/16, 16]
        v = flat[:, :, 1].reshape(n, h, d // 16, bs // 2, 16, 2).permute(1, 0, 3, 5, 2, 4)
        return k.reshape(h, n * bs, d), v.reshape(h, n * bs, d)

    def scatter(self, kv: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: Any) -> None:
        n, h, bs, d = blocks.numel(), self.num_heads, self.block_size, self.head_dim
        kp = k.reshape(h, n, bs // 16, 16, d // 2, 2).permute(1, 0, 2, 4, 3, 5).reshape(n, h, -1)
        vp = v.reshape(h, n, bs // 2, 2, d // 16, 16).permute(1, 0, 4, 2, 5, 3).reshape(n, h, -1)
        kv.index_copy_(0, blocks, torch_cat_last(kp, vp).reshape(n, h, bs, 2 * d))


class PagedKVLayout(DeviceLayout):
    """vLLM GPU backends: the logical per-layer view ``[B, H, N, 2*D]``.

    Each token holds ``K | V``. vLLM 0.32 hands over every standard backend's
    cache in this logical shape. Only the strides hold the physical order.
    torch indexing follows them. FlashAttention and Triton use NHD. FlashInfer
    prefers HND. Subclasses differ only in the stride order they accept.
    """

    name = "paged_kv"
    stride_order: ClassVar[tuple[int, ...] | None] = None
    """Logical dims from outermost to innermost in memory; None accepts any order."""

    def expected_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (shape[0], self.num_heads, self.block_size, 2 * self.head_dim)

    def check(self, kv: torch.Tensor) -> None:
        super().check(kv)
        # A size-1 dim has no meaningful stride. One KV head per rank gives one.
        wanted = tuple(d for d in self.stride_order or () if kv.shape[d] > 1)
        if self.stride_order is not None and physical_order(kv) != wanted:
            raise ConfigError(
                f"{self.name} layout expects stride order {self.stride_order}, tensor has "
                f"strides {tuple(kv.stride())}"
            )

    def gather(self, kv: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pages = kv.index_select(0, blocks)  # [n, H, N, 2D]
        n, d = blocks.numel(), self.head_dim
        k = _tokens(pages[..., :d].permute(1, 0, 2, 3), n, self.block_size)
        v = _tokens(pages[..., d:].permute(1, 0, 2, 3), n, self.block_size)
        return k, v

    def scatter(self, kv: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: Any) -> None:
        n, h, bs, d = blocks.numel(), self.num_heads, self.block_size, self.head_dim
        kp = k.reshape(h, n, bs, d).permute(1, 0, 2, 3)
        vp = v.reshape(h, n, bs, d).permute(1, 0, 2, 3)
        kv.index_copy_(0, blocks, torch_cat_last(kp, vp))

    # A run of consecutive blocks is a view of the cache: one strided copy per tensor.

    def gather_range(
        self, kv: torch.Tensor, first: int, count: int, k_out: torch.Tensor, v_out: Any
    ) -> None:
        pages, h, bs, d = kv[first : first + count], self.num_heads, self.block_size, self.head_dim
        k_out.view(h, count, bs, d).copy_(pages[..., :d].permute(1, 0, 2, 3))
        v_out.view(h, count, bs, d).copy_(pages[..., d:].permute(1, 0, 2, 3))

    def scatter_range(
        self, kv: torch.Tensor, first: int, count: int, k: torch.Tensor, v: Any
    ) -> None:
        pages, h, bs, d = kv[first : first + count], self.num_heads, self.block_size, self.head_dim
        pages[..., :d].copy_(k.view(h, count, bs, d).permute(1, 0, 2, 3))
        pages[..., d:].copy_(v.view(h, count, bs, d).permute(1, 0, 2, 3))


class FlashAttnLayout(PagedKVLayout):
    """FlashAttention and Triton: NHD in memory, ``[B, N, H, 2*D]``, vLLM's ``LBNHC``."""

    name = "flash_attn"
    stride_order = (0, 2, 1, 3)


class FlashInferNHDLayout(PagedKVLayout):
    """FlashInfer NHD: the same memory order as FlashAttention, ``LBNHC``."""

    name = "flashinfer_nhd"
    stride_order = (0, 2, 1, 3)


class FlashInferHNDLayout(PagedKVLayout):
    """FlashInfer HND: heads outside tokens in each block, ``[B, H, N, 2*D]``, ``LBHNC``."""

    name = "flashinfer_hnd"
    stride_order = (0, 1, 2, 3)


class MLALayout(DeviceLayout):
    """MLA: ``[B, 1, N, latent]``, one compressed latent per token and no V.

    The latent includes its rope part.
    """

    name = "mla"
    has_values = False

    def expected_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (shape[0], 1, self.block_size, self.head_dim)

    def gather(self, kv: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, None]:
        pages = kv.index_select(0, blocks)
        return pages.reshape(blocks.numel() * self.block_size, self.head_dim), None

    def scatter(self, kv: torch.Tensor, blocks: torch.Tensor, k: torch.Tensor, v: Any) -> None:
        kv.index_copy_(0, blocks, k.reshape(blocks.numel(), 1, self.block_size, self.head_dim))


def physical_order(t: torch.Tensor) -> tuple[int, ...]:
    """Logical dims of size > 1, from the largest stride to the smallest.

    Ties keep their order.
    """
    dims = [i for i in range(t.dim()) if t.shape[i] > 1]
    strides = t.stride()
    return tuple(sorted(dims, key=lambda i: (-strides[i], i)))


def torch_cat_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.cat((a, b), dim=-1)


LAYOUTS: dict[str, type[DeviceLayout]] = {
    cls.name: cls
    for cls in (
        CpuVecLayout,
        CpuAmxLayout,
        FlashAttnLayout,
        FlashInferNHDLayout,
        FlashInferHNDLayout,
        PagedKVLayout,
        MLALayout,
    )
}


# vec16 serves block sizes that are not a multiple of 32. It writes its pages exactly as vec
# does; tests check this against vLLM's own cache-write op.
_CPU_ISA_LAYOUTS = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}
"""Map from CPU attention ISA to layout."""


def detect_layout(
    kv: torch.Tensor,
    *,
    num_heads: int,
    head_dim: int,
    block_size: int,
    backend: str | None = None,
    cpu_isa: str | None = None,
    mla: bool = False,
) -> DeviceLayout:
    """Pick the layout of one layer's KV tensor.

    ``backend`` is vLLM's attention backend name, such as ``CPU_ATTN``,
    ``FLASH_ATTN`` or ``FLASHINFER``. ``cpu_isa`` is the CPU attention ISA,
    such as ``vec`` or ``amx``. The CPU backend reinterprets its pages. So it
    is recognised by name. GPU backends share the logical ``[B, H, N, 2*D]``
    view. Their strides tell them apart. An unknown layout raises
    :class:`ConfigError` that names what was seen.
    """
    args = {"num_heads": num_heads, "head_dim": head_dim, "block_size": block_size}
    shape = tuple(kv.shape)
    if mla:
        candidates = ["mla"]
    elif backend == "CPU_ATTN" or (backend is None and kv.device.type == "cpu" and cpu_isa):
        isa = cpu_isa or "vec"
        if isa not in _CPU_ISA_LAYOUTS:
            raise ConfigError(
                f"CPU attention ISA {isa!r} packs KV pages in a way chunkstore does not "
                f"convert yet (supported: {', '.join(_CPU_ISA_LAYOUTS)}); vLLM picks the ISA "
                "from the CPU, dtype and block size: try --block-size 32 or 64"
            )
        candidates = [_CPU_ISA_LAYOUTS[isa]]
    elif backend is not None and backend.startswith("FLASHINFER"):
        candidates = ["flashinfer_hnd", "flashinfer_nhd"]
    elif backend is not None and backend.startswith(("FLASH_ATTN", "TRITON", "ROCM")):
        candidates = ["flash_attn"]
    elif backend is None:
        candidates = ["flash_attn", "flashinfer_hnd"]
    else:
        raise ConfigError(
            f"attention backend {backend!r} has no known KV layout in chunkstore; "
            f"known layouts: {', '.join(LAYOUTS)}"
        )
    for name in candidates:
        layout = LAYOUTS[name](**args)
        try:
            layout.check(kv)
        except ConfigError:
            continue
        return layout
    raise ConfigError(
        f"unknown KV cache layout: tensor shape {shape} strides {tuple(kv.stride())} on "
        f"{kv.device}, backend {backend!r}, cpu isa {cpu_isa!r}, heads={num_heads} "
        f"head_dim={head_dim} block_size={block_size}; tried {', '.join(candidates)}"
    )
