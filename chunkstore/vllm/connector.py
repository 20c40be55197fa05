"""``ChunkStoreConnector``: vLLM's KV connector interface over chunkstore.

Configuration alone loads it::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "ChunkStoreConnector",
        "kv_connector_module_path": "chunkstore.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_cache": "8G", "tiers": ["file:///mnt/kv"]}}'

Each role gets its own instance. The scheduler's instance plans keys,
lookups, loads and saves. Each worker's instance moves bytes. This class only
dispatches to
:class:`~chunkstore.vllm.scheduler.ChunkStoreScheduler` and
:class:`~chunkstore.vllm.worker.ChunkStoreWorker`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from chunkstore.errors import ConfigError
from chunkstore.metrics import MetricsServer, start_metrics_server
from chunkstore.node import NodeCache, NodeRankCache
from chunkstore.tiering import ProcessCache, RankCache
from chunkstore.vllm.config import ConnectorConfig, parse_config
from chunkstore.vllm.engine import EngineKV, describe_engine
from chunkstore.vllm.events import ConnectorEvents, event_groups, tier_mediums
from chunkstore.vllm.metadata import ChunkStoreMetadata
from chunkstore.vllm.scheduler import ChunkStoreScheduler
from chunkstore.vllm.shared import acquire_shared, release_shared
from chunkstore.vllm.stats import ChunkStorePromMetrics, ChunkStoreStats
from chunkstore.vllm.worker import ChunkStoreWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["ChunkStoreConnector"]

# ChunkStoreMetadata needs no vLLM, for worker processes that never import it. vLLM's base
# class is an empty marker, so a virtual subclass suffices.
KVConnectorMetadata.register(ChunkStoreMetadata)


class ChunkStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """KV connector that loads and saves prefix chunks through chunkstore's tiers."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        try:
            self.cfg: ConnectorConfig = parse_config(
                transfer.kv_connector_extra_config,
                block_size=int(vllm_config.cache_config.block_size),
                kv_role=transfer.kv_role,
            )
        except ConfigError as exc:
            raise ConfigError(f"ChunkStoreConnector: {exc}") from None
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            tp_rank = _tp_rank()
        self.engine: EngineKV = describe_engine(
            vllm_config, kv_cache_config, self.cfg, tp_rank=tp_rank
        )
        self.pool_name = self.cfg.shared_pool or f"vllm-{transfer.engine_id}"
        self.scheduler: ChunkStoreScheduler | None = None
        self.worker: ChunkStoreWorker | None = None
        self.store: ProcessCache | RankCache | NodeCache
        if role == KVConnectorRole.WORKER and self.engine.tp_size > 1 and self.cfg.node:
            # Each TP rank attaches to the node service. It writes its heads into the slot
            # the engine's ranks share. The service seals the chunk.
            self.store = self._make_node_store(rank=self.engine.tp_rank)
            self._release_store: Callable[[], None] = self.store.close
        elif role == KVConnectorRole.WORKER and self.engine.tp_size > 1:
            # TP workers run in their own processes. They attach the scheduler's host pool
            # and write their heads into shared slots; they hold no cache of their own.
            self.store = RankCache(
                self.pool_name,
                self.engine.layout,
                rank=self.engine.tp_rank,
                tp=self.engine.tp_size,
            )
            # A rank detaches from the pool; the scheduler's store owns it and its /dev/shm name.
            self._release_store = self.store.close
        else:
            # TP=1: vLLM runs the single worker inside the engine core. Scheduler and
            # worker share this process's store by name.
            if self.cfg.node is not None:
                self.store = acquire_shared(self.pool_name, self._make_node_store)
            else:
                self.store = acquire_shared(self.pool_name, self._make_store)
            # The last connector of the engine in this process closes the store: its host pool,
            # tier threads and, at TP > 1, the pool's /dev/shm name.
            self._release_store = functools.partial(release_shared, self.pool_name)
        self.shut_down = False
        """Whether :meth:`shutdown` has released this connector's hold on the store."""
        self.metrics_server: MetricsServer | None = None
        self.events: ConnectorEvents | None = None
        """KV events for vLLM's publisher, on the scheduler side with ``--kv-events-config``."""
        if role == KVConnectorRole.SCHEDULER:
            assert isinstance(self.store, (ProcessCache, NodeCache))
            self.scheduler = ChunkStoreScheduler(self.engine, self.cfg, self.store)
            if _kv_events_enabled(vllm_config) and isinstance(self.store, ProcessCache):
                self.events = self._watch_store(self.store)
                self.scheduler.events = self.events
            if self.cfg.metrics_port is not None:
                self.metrics_server = start_metrics_server(self.cfg.metrics_port)
                log.info("chunkstore: metrics at %s", self.metrics_server.url)
        else:
            self.worker = ChunkStoreWorker(self.engine, self.cfg, self.store, vllm_config)
        log.info(
            "chunkstore: %s connector, model %s, namespace fingerprint %s, tiers %s",
            role.name.lower(),
            self.engine.spec.model_id,
            self.engine.layout.fingerprint.hex()[:16],
            list(self.cfg.tiers) or "none",
        )

    def _make_node_store(self, rank: int | None = None) -> NodeCache:
        """The store over the node service.

        The scheduler and a TP=1 worker get the engine's store. A worker at TP>1
        gets the store of its rank ``rank``.
        """
        assert self.cfg.node is not None
        engine_id = str(self._kv_transfer_config.engine_id)
        name = f"{engine_id}:{os.getpid()}"
        try:
            if rank is None:
                return NodeCache(self.cfg.node, layout=self.engine.layout, client_name=name)
            return NodeRankCache(
                self.cfg.node,
                layout=self.engine.layout,
                rank=rank,
                tp=self.engine.tp_size,
                # vLLM gives every rank of a TP group rank 0's engine_id. It is unique per engine
                # and data-parallel replica. The node assembles parts by it.
                engine=engine_id,
                client_name=name,
            )
        except ConfigError as exc:
            raise ConfigError(f"ChunkStoreConnector: {exc}") from None

    def _watch_store(self, store: ProcessCache) -> ConnectorEvents:
        """Events for the chunks that ``store``'s host memory and tiers hold."""
        cache = store.host.cache
        events = ConnectorEvents(
            block_size=self.engine.block_size,
            blocks_per_chunk=self.engine.blocks_per_chunk,
            mediums=tier_mediums(cache.name, store.tiers),
            # Every chunk host memory holds, and as many again on their way to the tiers.
            identities=2 * cache.num_slots + 4096,
            groups=event_groups(self._kv_cache_config),
            hash_block_size=_hash_block_size(self._vllm_config, self._kv_cache_config),
        )
        store.tiered.watch(events.buffer)
        return events

    def _make_store(self) -> ProcessCache:
        return ProcessCache(
            host_bytes=self.cfg.host_cache_bytes,
            tiers=self.cfg.tiers,
            store_options={k: dict(v) for k, v in self.cfg.store_options.items()},
            compression=self.cfg.compression,
            layout=self.engine.layout,
            policy=self.cfg.host_policy,
            # At TP > 1 the rank processes attach this pool by name to assemble chunks.
            shm_name=self.pool_name if self.engine.tp_size > 1 else None,
        )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33+ asks before enabling sleep mode. chunkstore registers no device memory;
        # NIXL moves host memory only. unregister_kv_caches drains the copies. So the KV cache
        # may be unmapped and remapped under chunkstore.
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never a correctness problem.
        return False

    # --- worker side --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33 sleep mode, before the KV cache is unmapped: finish our copies in flight.
        if self.worker is not None:
            self.worker.suspend()

    def restore_kv_caches(self) -> None:
        if self.worker is not None:
            self.worker.resume()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, ChunkStoreMetadata)
            self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves run once per step in wait_for_save, for all layers together

    def wait_for_save(self) -> None:
        if self.worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, ChunkStoreMetadata)
            self.worker.wait_for_save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        done, failed = self.worker.take_transfer_results()
        # Failed receives must also be reported as finished (base.py contract).
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> ChunkStoreStats | None:
        half = self.worker or self.scheduler
        data = half.take_stats() if half is not None else None
        return ChunkStoreStats(data=data) if data is not None else None

    def shutdown(self) -> None:
        # Idempotent: vLLM may call it from the engine core and again from a finalizer.
        if self.shut_down:
            return
        self.shut_down = True
        if self.events is not None and isinstance(self.store, ProcessCache):
            self.store.tiered.watch(None)
        try:
            if self.worker is not None:
                self.worker.drain()
            self.store.flush(timeout=30)
        finally:
            self._release_store()
            if self.metrics_server is not None:
                self.metrics_server.close()
                self.metrics_server = None

    # --- scheduler side -------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler is not None:
            self.scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self.scheduler is not None
        return self.scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        # A registered virtual subclass (see above), which mypy cannot see.
        return cast(KVConnectorMetadata, self.scheduler.build_connector_meta(scheduler_output))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request)

    def take_events(self) -> Iterable[Any]:
        # vLLM's scheduler publishes these with its own events, each step.
        return self.events.take() if self.events is not None else ()

    def reset_cache(self) -> bool | None:
        return self.scheduler.reset_cache() if self.scheduler is not None else None

    # --- metrics --------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ChunkStoreStats:
        return ChunkStoreStats(data=dict(data)) if data is not None else ChunkStoreStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> ChunkStorePromMetrics:
        return ChunkStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int | None:
    """The tokens one of ``request.block_hashes`` spans, where vLLM says (it resolves it
    before it builds the scheduler); None: the block size."""
    for config in (kv_cache_config, getattr(vllm_config, "cache_config", None)):
        value = getattr(config, "hash_block_size", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _kv_events_enabled(vllm_config: Any) -> bool:
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and config.enable_kv_cache_events)


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialised (unit tests): rank 0
        return 0
