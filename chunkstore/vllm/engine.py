"""The engine's KV cache as the format sees it: a KVSpec, its ChunkLayout and per-layer facts.

The connector builds it at start-up from vLLM's ``VllmConfig`` and
``KVCacheConfig``. The scheduler and every worker build it the same way. So
both sides derive the same keys and chunk layout. The spec leaves out TP
size, block size and attention backend. Chunks are shared across them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkstore.errors import ConfigError
from chunkstore.format import (
    ATTENTION,
    MLA,
    SLIDING_WINDOW,
    ChunkLayout,
    KVSpec,
    LayerGroup,
    rank_share,
)
from chunkstore.hashing import ChunkKey, chain_keys, namespace_root
from chunkstore.vllm.config import ConnectorConfig

__all__ = ["EngineKV", "LayerInfo", "describe_engine"]


@dataclass(frozen=True, slots=True)
class LayerInfo:
    """One attention layer of this worker."""

    name: str
    """vLLM layer name, the key of ``register_kv_caches``."""
    layer: int
    """Global layer index in the model."""
    group: int
    """vLLM KV cache group index, which picks its block ids list."""
    kind: str
    """Format layer-group kind: attention, sliding_window or mla."""
    head_start: int
    """First canonical head this rank holds."""
    head_stop: int
    """One past the last canonical head this rank holds."""
    head_dim: int
    """Elements per head per token."""
    writer: bool
    """Whether this rank writes this layer's heads into chunks."""


@dataclass(frozen=True, slots=True)
class EngineKV:
    """What the connector knows about the engine's KV cache."""

    spec: KVSpec
    """Canonical description: model, dtype, chunk_tokens and groups."""
    layout: ChunkLayout
    """Byte layout of every chunk."""
    layers: dict[str, LayerInfo]
    """Attention layers by vLLM layer name."""
    block_size: int
    """Engine block size in tokens per block, the same for every group."""
    tp_rank: int
    """This worker's tensor-parallel rank."""
    tp_size: int
    """Tensor-parallel size."""
    num_groups: int
    """Number of vLLM KV cache groups, more than one for hybrid models."""
    namespace_extra: str | None
    """Operator-chosen namespace string."""

    @property
    def chunk_tokens(self) -> int:
        return self.spec.chunk_tokens

    @property
    def blocks_per_chunk(self) -> int:
        return self.spec.chunk_tokens // self.block_size

    def root(
        self, *, lora: Any = None, cache_salt: str | None = None, mm_hashes: Sequence[str] = ()
    ) -> bytes:
        """Namespace root for a request: the model fingerprint and what sets its KV apart."""
        return namespace_root(
            self.layout.fingerprint,
            extra={
                "lora": lora,
                "cache_salt": cache_salt,
                "mm": list(mm_hashes) or None,
                "namespace": self.namespace_extra,
            },
        )

    def root_of(self, request: Any) -> bytes:
        """Namespace root of a vLLM ``Request``: its LoRA, ``cache_salt`` and multimodal hashes.

        The connector and the native tier both derive the root here. A chunk
        saved through one is thus found through the other.
        """
        lora = getattr(request, "lora_request", None)
        mm = [f.identifier for f in (getattr(request, "mm_features", None) or [])]
        return self.root(
            lora=getattr(lora, "lora_name", None) if lora is not None else None,
            cache_salt=getattr(request, "cache_salt", None),
            mm_hashes=mm,
        )

    def keys(self, tokens: Any, root: bytes, after: ChunkKey | None = None) -> list[ChunkKey]:
        """Keys of every full chunk of ``tokens`` after the chunk keyed ``after``."""
        return chain_keys(tokens, root=root, chunk_tokens=self.spec.chunk_tokens, after=after)


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))


def describe_engine(
    vllm_config: Any, kv_cache_config: Any, cfg: ConnectorConfig, *, tp_rank: int = 0
) -> EngineKV:
    """Derive the canonical KV description.

    Raises :class:`ConfigError` for an unsupported cache type.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    if not 0 <= tp_rank < tp_size:
        raise ConfigError(f"tp_rank {tp_rank} outside TP size {tp_size}")
    if int(parallel.pipeline_parallel_size) != 1:
        raise ConfigError("ChunkStoreConnector does not support pipeline parallelism yet")
    total_heads = int(model_config.get_total_num_kv_heads())

    groups: list[LayerGroup] = []
    layers: dict[str, LayerInfo] = {}
    dtypes: set[str] = set()
    block_sizes: set[int] = set()
    for gi, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        head_dim = int(spec.head_size)
        window = None
        if isinstance(spec, MLAAttentionSpec):
            kind, heads = MLA, 1
        elif isinstance(spec, SlidingWindowSpec):
            kind, heads, window = SLIDING_WINDOW, total_heads, int(spec.sliding_window)
        elif type(spec) is FullAttentionSpec:
            kind, heads = ATTENTION, total_heads
        else:
            raise ConfigError(
                f"KV cache group {gi} is a {type(spec).__name__}; ChunkStoreConnector handles "
                "full attention, sliding window and MLA groups only"
            )
        if kind != MLA and getattr(spec, "head_size_v", head_dim) != head_dim:
            raise ConfigError(f"KV cache group {gi}: K and V head sizes differ")
        dtypes.add(str(spec.dtype))
        block_sizes.add(int(spec.block_size))
        indices = tuple(sorted(_layer_index(n) for n in group.layer_names))
        groups.append(LayerGroup(kind, indices, heads, head_dim, window))
        for name in group.layer_names:
            if kind == MLA:
                share_start, share_stop, writer = 0, 1, tp_rank == 0
            else:
                share = rank_share(tp_rank, tp_size, heads)
                share_start, share_stop, writer = share.start, share.stop, share.writer
                if int(spec.num_kv_heads) != share_stop - share_start:
                    raise ConfigError(
                        f"layer {name}: {spec.num_kv_heads} KV heads on this rank, expected "
                        f"{share_stop - share_start} of {heads} at TP={tp_size}"
                    )
            layers[name] = LayerInfo(
                name, _layer_index(name), gi, kind, share_start, share_stop, head_dim, writer
            )
    if len(dtypes) != 1:
        raise ConfigError(f"KV cache groups use several dtypes {sorted(dtypes)}")
    if len(block_sizes) != 1:
        raise ConfigError(f"KV cache groups use several block sizes {sorted(block_sizes)}")
    block_size = block_sizes.pop()
    if cfg.chunk_tokens % block_size:
        raise ConfigError(
            f"chunk_tokens: {cfg.chunk_tokens} is not a multiple of the block size {block_size}"
        )
    dtype = dtypes.pop()
    extra: list[tuple[str, str]] = []
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        extra.append(("kv_cache_dtype", cache_dtype))
    revision = getattr(model_config, "revision", None)
    if revision:
        extra.append(("revision", str(revision)))
    spec = KVSpec(
        model_id=cfg.model_id or str(model_config.model),
        dtype=dtype,
        chunk_tokens=cfg.chunk_tokens,
        groups=tuple(sorted(groups, key=lambda g: g.layers[0])),
        extra=tuple(extra),
    )
    return EngineKV(
        spec=spec,
        layout=ChunkLayout(spec),
        layers=layers,
        block_size=block_size,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_groups=len(kv_cache_config.kv_cache_groups),
        namespace_extra=cfg.namespace,
    )
