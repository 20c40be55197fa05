"""Worker side: device pages <-> chunks in host memory, through the detected layout.

Loads run in ``start_load_kv`` (before the forward pass for synchronous
loads). Saves run in ``wait_for_save``, after the step's forward pass has
written the blocks: one gather per layer for all chunks of the step, one copy
into each chunk's host buffer, then seal and hand to the store (which writes
secondary tiers behind). On CPU these are plain copies; on CUDA the device ->
host copy is the only part that touches the device.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch

from chunkstore.errors import ChunkStoreError, ConfigError
from chunkstore.format import MLA, decode_chunk, seal_chunk
from chunkstore.vllm.config import ConnectorConfig
from chunkstore.vllm.engine import EngineKV
from chunkstore.vllm.layouts import DeviceLayout, detect_layout
from chunkstore.vllm.metadata import ChunkLoad, ChunkStoreMetadata
from chunkstore.vllm.stats import ChunkStoreStats
from chunkstore.vllm.tiers import ConnectorStore

log = logging.getLogger(__name__)

__all__ = ["ChunkStoreWorker"]

_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
}


class ChunkStoreWorker:
    """The worker-role half of :class:`~chunkstore.vllm.ChunkStoreConnector`."""

    def __init__(
        self, engine: EngineKV, cfg: ConnectorConfig, store: ConnectorStore, vllm_config: Any = None
    ) -> None:
        self.engine = engine
        self.cfg = cfg
        self.store = store
        self.vllm_config = vllm_config
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, DeviceLayout] = {}
        self.torch_dtype = _TORCH_DTYPES[engine.layout.dtype.name]
        self._load_errors: set[int] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.stats = ChunkStoreStats()

    # --- registration -------------------------------------------------------------

    def register_kv_caches(
        self, kv_caches: dict[str, torch.Tensor], backends: dict[str, str] | None = None
    ) -> None:
        """Detect each layer's layout; unknown layouts raise :class:`ConfigError` at start-up."""
        backends = backends if backends is not None else self._backend_names()
        for name, kv in kv_caches.items():
            info = self.engine.layers.get(name)
            if info is None:
                raise ConfigError(
                    f"vLLM registered KV cache {name!r}, which no KV cache group lists"
                )
            backend = backends.get(name)
            isa = None
            if backend == "CPU_ATTN" or (backend is None and kv.device.type == "cpu"):
                isa = _cpu_isa(self.torch_dtype, self.engine.block_size, info.head_dim)
            self.layouts[name] = detect_layout(
                kv,
                num_heads=info.head_stop - info.head_start,
                head_dim=info.head_dim,
                block_size=self.engine.block_size,
                backend=backend,
                cpu_isa=isa,
                mla=info.kind == MLA,
            )
            if kv.dtype != self.torch_dtype:
                raise ConfigError(f"{name}: KV cache dtype {kv.dtype}, expected {self.torch_dtype}")
        self.kv_caches = dict(kv_caches)
        kinds = sorted({layout.name for layout in self.layouts.values()})
        log.info(
            "chunkstore: %d KV layers, layout(s) %s, chunk %d tokens, %.1f MiB per chunk",
            len(kv_caches),
            ", ".join(kinds),
            self.engine.chunk_tokens,
            self.engine.layout.total_size / 2**20,
        )

    def _backend_names(self) -> dict[str, str]:
        if self.vllm_config is None:
            return {}
        try:
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

            layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
            return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}
        except Exception as exc:  # noqa: BLE001 - fall back to shape-based detection
            log.debug("chunkstore: cannot read attention backends: %s", exc)
            return {}

    # --- views of a chunk buffer -------------------------------------------------------

    def _views(self, buf: Any, base: int | None = None) -> dict[str, torch.Tensor]:
        """Torch views of every tensor of a chunk buffer (no copy).

        ``base`` is where the payload starts in ``buf``: the layout's data
        offset for a whole chunk file (default), 0 for a bare payload.
        """
        layout = self.engine.layout
        with warnings.catch_warnings():
            # Host chunks are read-only bytes on loads; torch only warns about it.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(buf, dtype=torch.uint8)
        out = {}
        for slot in layout.tensors:
            start = (layout.data_offset if base is None else base) + slot.offset
            out[slot.name] = (
                raw[start : start + slot.nbytes].view(self.torch_dtype).view(slot.shape)
            )
        return out

    # --- loads ---------------------------------------------------------------------

    def start_load_kv(self, meta: ChunkStoreMetadata) -> None:
        if not meta.loads or not self.kv_caches:
            for req_id in meta.async_load_reqs:
                self._finished_recving.add(req_id)
            return
        t0 = time.perf_counter()
        failed_reqs: set[str] = set()
        for load in meta.loads:
            if load.req_id in failed_reqs:
                self._fail(load)
                continue
            try:
                self._load_one(load)
            except Exception as exc:  # noqa: BLE001 - any failure becomes a recompute
                log.warning(
                    "chunkstore: load of %s for %s failed: %s", load.key.hex, load.req_id, exc
                )
                failed_reqs.add(load.req_id)
                self._fail(load)
        for req_id in meta.async_load_reqs:
            self._finished_recving.add(req_id)
        self.stats.add("load_seconds", time.perf_counter() - t0)

    def _fail(self, load: ChunkLoad) -> None:
        self.stats.add("load_errors")
        # Drop the chunk from host memory so vLLM's retry sees a shorter hit, not a loop.
        self.store.host.delete(load.key)
        if load.is_async:
            self._failed_recving.add(load.req_id)
        else:
            for group in load.block_ids:
                self._load_errors.update(b for b in group[load.skip_blocks :] if b)

    def _load_one(self, load: ChunkLoad) -> None:
        with self.store.read_host(load.key) as data:
            if data is None:
                raise ChunkStoreError("chunk left host memory before it was loaded")
            chunk = decode_chunk(
                data,
                verify=self.cfg.verify_host,
                expected_key=load.key.digest,
                expected_fingerprint=self.engine.layout.fingerprint,
            )
            self._scatter_chunk(load, self._views(chunk.payload, base=0))
        self.stats.add("loaded_chunks")
        self.stats.add("loaded_bytes", self.engine.layout.payload_size)

    def _scatter_chunk(self, load: ChunkLoad, views: dict[str, torch.Tensor]) -> None:
        bs = self.engine.block_size
        skip = load.skip_blocks
        for name, kv in self.kv_caches.items():
            info = self.engine.layers[name]
            ids = load.block_ids[info.group][skip:]
            keep = [j for j, b in enumerate(ids) if b]  # 0 = null block (sliding window gap)
            if not keep:
                continue
            blocks = torch.tensor([ids[j] for j in keep], dtype=torch.long, device=kv.device)
            token_idx = torch.cat(
                [torch.arange((skip + j) * bs, (skip + j + 1) * bs) for j in keep]
            )
            layout = self.layouts[name]
            if info.kind == MLA:
                k = views[f"layers.{info.layer}.latent"].index_select(0, token_idx)
                layout.scatter(kv, blocks, k.to(kv.device), None)
                continue
            heads = slice(info.head_start, info.head_stop)
            k = views[f"layers.{info.layer}.k"][heads].index_select(1, token_idx)
            v = views[f"layers.{info.layer}.v"][heads].index_select(1, token_idx)
            layout.scatter(kv, blocks, k.to(kv.device), v.to(kv.device))

    # --- saves ----------------------------------------------------------------------

    def wait_for_save(self, meta: ChunkStoreMetadata) -> None:
        if not meta.saves or not self.kv_caches:
            return
        if self.engine.tp_size != 1:
            # Merging TP shards needs the shared host pool (see vllm-needs.md); refuse quietly.
            return
        t0 = time.perf_counter()
        layout = self.engine.layout
        c = self.engine.chunk_tokens
        buffers = [bytearray(layout.total_size) for _ in meta.saves]
        views = [self._views(buf) for buf in buffers]
        for name, kv in self.kv_caches.items():
            info = self.engine.layers[name]
            if not info.writer:
                continue
            blocks = torch.tensor(
                [b for s in meta.saves for b in s.block_ids[info.group]],
                dtype=torch.long,
                device=kv.device,
            )
            k_all, v_all = self.layouts[name].gather(kv, blocks)
            k_all = k_all.to("cpu")
            v_all = v_all.to("cpu") if v_all is not None else None
            for j, view in enumerate(views):
                tokens = slice(j * c, (j + 1) * c)
                if info.kind == MLA:
                    view[f"layers.{info.layer}.latent"].copy_(k_all[tokens])
                    continue
                heads = slice(info.head_start, info.head_stop)
                view[f"layers.{info.layer}.k"][heads].copy_(k_all[:, tokens])
                view[f"layers.{info.layer}.v"][heads].copy_(v_all[:, tokens])
        for save, buf in zip(meta.saves, buffers):
            seal_chunk(
                layout,
                buf,
                key=save.key.digest,
                parent=save.parent,
                namespace=save.key.namespace,
                tokens=list(save.tokens),
                verify_key=False,
            )
            self.store.put(save.key, buf)
        self.stats.add("saved_chunks", len(meta.saves))
        self.stats.add("saved_bytes", len(meta.saves) * layout.payload_size)
        self.stats.add("save_seconds", time.perf_counter() - t0)

    # --- results -------------------------------------------------------------------

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) since the last call."""
        done, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return done, failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> ChunkStoreStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, ChunkStoreStats()
        return stats


def _cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str | None:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size))
    except Exception:  # noqa: BLE001 - no CPU backend in this vLLM build
        return None
