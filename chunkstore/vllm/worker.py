"""The worker side: copies between device pages and chunks in host memory.

The detected layout converts the pages. Loads are issued in ``start_load_kv``.
Synchronous loads thus come before the forward pass. Saves are issued in
``wait_for_save``, after the forward pass wrote the blocks. Each layer gets one
gather for all of the step's chunks. It writes each chunk's rank part. A copy
to host follows.

The copier from :mod:`chunkstore.device` decides where the bytes live and how
they move. On CPU the conversion writes into the host buffers directly. All
work is done on return. On CUDA the work runs on a side stream. The worker
polls its events in :meth:`ChunkStoreWorker.poll`, once a step. Polling seals
finished saves and hands them to the store. It releases the host slots of
finished loads. It reports finished asynchronous loads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from chunkstore.device import Batch, DeviceCopier, Fence, ShardMap, select_copier
from chunkstore.errors import ChunkStoreError, ConfigError
from chunkstore.format import MLA, decode_chunk
from chunkstore.tiering import EngineCache, SaveSlot
from chunkstore.vllm.config import ConnectorConfig
from chunkstore.vllm.counters import Counters
from chunkstore.vllm.engine import EngineKV
from chunkstore.vllm.layouts import DeviceLayout, detect_layout
from chunkstore.vllm.metadata import ChunkLoad, ChunkSave, ChunkStoreMetadata

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


# A batch is one step's copies in one direction.
_MAX_IN_FLIGHT = 4
"""Most batches of copies unfinished at once."""


@dataclass
class _Pending:
    fence: Fence
    started: float
    nbytes: int


@dataclass
class _PendingLoad(_Pending):
    leases: ExitStack
    """Pins on the host slots being read."""
    chunks: int
    async_reqs: set[str]
    """Asynchronous loads to report finished once the copies are complete."""
    failed_reqs: set[str]
    """Asynchronous loads to report failed once the copies are complete."""
    # A node service can take its pins back. Each check runs once the copies are complete, and
    # a failed check fails its load.
    checks: list[tuple[ChunkLoad, Callable[[], bool]]]
    """Loads whose host bytes the store may take back during the copy, with their checks."""

    @property
    def checks_sync_loads(self) -> bool:
        """Whether a synchronous load awaits its check.

        Such a load is reported in the step that loads it.
        """
        return any(not load.is_async for load, _ in self.checks)


@dataclass
class _PendingSave(_Pending):
    saves: list[ChunkSave]
    slots: list[SaveSlot]
    """Where each save's bytes go; the save is sealed and stored when complete."""


class ChunkStoreWorker:
    """The worker-role half of :class:`~chunkstore.vllm.ChunkStoreConnector`.

    ``metrics`` receives every batch of device copies as
    ``chunkstore_device_*{direction="device_to_host"|"host_to_device"}``.
    It defaults to the process's :func:`chunkstore.metrics.default_metrics`.
    """

    def __init__(
        self,
        engine: EngineKV,
        cfg: ConnectorConfig,
        store: EngineCache,
        vllm_config: Any = None,
        *,
        metrics: Any = None,
    ) -> None:
        self.engine = engine
        self.cfg = cfg
        self.store = store
        self.vllm_config = vllm_config
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, DeviceLayout] = {}
        self.torch_dtype = _TORCH_DTYPES[engine.layout.dtype.name]
        self.copier: DeviceCopier | None = None
        """The copier, chosen in :meth:`register_kv_caches` from the KV cache's device."""
        layout, rank, tp = engine.layout, engine.tp_rank, engine.tp_size
        self.read_map = ShardMap.build(layout, rank, tp, for_write=False)
        """This rank's part of a chunk on loads: its heads and MLA latents."""
        # Only rank 0 saves MLA latents.
        self.write_map = ShardMap.build(layout, rank, tp, for_write=True)
        """This rank's part of a chunk on saves: its owned heads."""
        if metrics is None:
            from chunkstore.metrics import default_metrics

            metrics = default_metrics()
        self.metrics = metrics
        self._pending: list[_PendingLoad | _PendingSave] = []
        self._load_errors: set[int] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self.stats = Counters()
        self.suspended = False
        """Whether vLLM sleep mode holds the worker, between :meth:`suspend` and :meth:`resume`."""
        # While suspended, device memory is not touched. Loads fail and are recomputed. Saves
        # are skipped and become future misses.

    # --- registration -------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        backends: dict[str, str] | None = None,
        copier: DeviceCopier | None = None,
        cpu_isa: str | None = None,
    ) -> None:
        """Detect each layer's layout.

        An unknown layout raises :class:`ConfigError` at start-up. ``copier``
        replaces the copier chosen from the tensors' device. ``cpu_isa``
        replaces the CPU attention ISA vLLM would pick. Tests that write pages
        themselves use both.
        """
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
                isa = cpu_isa or _cpu_isa(self.torch_dtype, self.engine.block_size, info.head_dim)
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
        devices = {kv.device for kv in kv_caches.values()}
        if len(devices) > 1:
            raise ConfigError(f"KV cache tensors on several devices: {sorted(map(str, devices))}")
        if copier is None and devices:
            copier = select_copier(devices.pop())
        self.copier = copier
        self.kv_caches = dict(kv_caches)
        kinds = sorted({layout.name for layout in self.layouts.values()})
        log.info(
            "chunkstore: %d KV layers, layout(s) %s, %s copies, chunk %d tokens, "
            "%.1f MiB per chunk",
            len(kv_caches),
            ", ".join(kinds),
            copier.name if copier is not None else "no",
            self.engine.chunk_tokens,
            self.engine.layout.total_size / 2**20,
        )

    def _backend_names(self) -> dict[str, str]:
        if self.vllm_config is None:
            return {}
        try:
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

            # vLLM's own callers pass this abstract base: it selects every attention layer.
            layers = get_layers_from_vllm_config(
                self.vllm_config,
                AttentionLayerBase,  # type: ignore[type-abstract]
            )
            return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}
        except Exception as exc:  # noqa: BLE001 - fall back to shape-based detection
            log.debug("chunkstore: cannot read attention backends: %s", exc)
            return {}

    # --- copies in flight ------------------------------------------------------------

    def poll(self) -> None:
        """Finish every batch whose device copies are complete, oldest first."""
        while self._pending and self._pending[0].fence.poll():
            self._finish(self._pending.pop(0))

    def drain(self) -> None:
        """Wait for every batch in flight and finish it."""
        while self._pending:
            pending = self._pending.pop(0)
            pending.fence.wait()
            self._finish(pending)

    def suspend(self) -> None:
        """Finish every copy in flight before vLLM's sleep mode unmaps the KV cache.

        Saves are sealed and handed to the store. Loads release their pinned
        host slots. Device memory is then left alone until :meth:`resume`. A
        second call does nothing.
        """
        self.drain()
        self.suspended = True

    def resume(self) -> None:
        """Mark the KV tensors valid again after wake-up.

        The tensors keep their virtual addresses. vLLM discarded their contents.
        It also resets its prefix cache. A second call does nothing.
        """
        self.suspended = False

    def _track(self, pending: _PendingLoad | _PendingSave) -> None:
        self._pending.append(pending)
        self.poll()
        # Bound the host buffers that unfinished copies hold: beyond the limit, wait for the
        # oldest.
        while len(self._pending) > _MAX_IN_FLIGHT:
            oldest = self._pending.pop(0)
            oldest.fence.wait()
            self._finish(oldest)

    def _finish(self, pending: _PendingLoad | _PendingSave) -> None:
        seconds = pending.fence.seconds
        if seconds is None:
            seconds = time.perf_counter() - pending.started
        if isinstance(pending, _PendingLoad):
            self._check_loads(pending)  # before the pins go: afterwards any slot may be reused
            pending.leases.close()  # the host slots may be evicted now
            self._finished_recving |= pending.async_reqs
            self._failed_recving |= pending.failed_reqs
            self.stats.add("loaded_chunks", pending.chunks)
            self.stats.add("loaded_bytes", pending.nbytes)
            self.stats.add("load_seconds", seconds)
            self.metrics.record_device_transfer("host_to_device", pending.nbytes, seconds)
            return
        t0 = time.perf_counter()
        self._store_saves(pending)
        self.stats.add("saved_chunks", len(pending.saves))
        self.stats.add("saved_bytes", pending.nbytes)
        self.stats.add("save_seconds", seconds + time.perf_counter() - t0)
        self.metrics.record_device_transfer("device_to_host", pending.nbytes, seconds)

    def _check_loads(self, pending: _PendingLoad) -> None:
        """Fail the loads whose host bytes were taken back during their copy.

        The device blocks may hold another chunk's bytes. vLLM must recompute
        them.
        """
        revoked = [load for load, still_held in pending.checks if not still_held()]
        if not revoked:
            return
        log.warning(
            "chunkstore: %d chunks were taken back by the node service during their copy "
            "(its session ended); they are recomputed",
            len(revoked),
        )
        for load in revoked:
            pending.async_reqs.discard(load.req_id)
            # The chunk itself is sound (its slot was reused, not damaged): keep it.
            self._fail(load, drop=False)
        pending.chunks -= len(revoked)

    def _store_saves(self, pending: _PendingSave) -> None:
        """Seal and store the chunks whose bytes are in host memory.

        At TP>1, mark this rank's part written instead. The last rank's mark
        seals the chunk. The owner publishes it.
        """
        for save, slot in zip(pending.saves, pending.slots):
            try:
                self.store.save_done(save, slot)
            except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
                log.warning("chunkstore: save of %s failed: %s", save.key.hex, exc)
                self.stats.add("save_errors")
                self.store.save_abandoned(slot)

    # --- loads ---------------------------------------------------------------------

    def start_load_kv(self, meta: ChunkStoreMetadata) -> None:
        self.poll()
        if self.suspended:
            for load in meta.loads:
                self._fail(load)
            return
        if not meta.loads or not self.kv_caches:
            self._finished_recving |= meta.async_load_reqs
            return
        t0 = time.perf_counter()
        failed_reqs: set[str] = set()
        leases = ExitStack()
        accepted: list[tuple[ChunkLoad, Any]] = []
        checks: list[tuple[ChunkLoad, Callable[[], bool]]] = []
        for load in meta.loads:
            if load.req_id in failed_reqs:
                self._fail(load, drop=False)  # sound, but past the request's failed chunk
                continue
            try:
                payload, check = self._open_chunk(load, leases)
                accepted.append((load, payload))
                if check is not None:
                    checks.append((load, check))
            except Exception as exc:  # noqa: BLE001 - any failure becomes a recompute
                log.warning(
                    "chunkstore: load of %s for %s failed: %s", load.key.hex, load.req_id, exc
                )
                failed_reqs.add(load.req_id)
                self._fail(load)
        ok_reqs = meta.async_load_reqs - failed_reqs
        failed_async = meta.async_load_reqs & failed_reqs
        if not accepted:
            leases.close()
            self._finished_recving |= meta.async_load_reqs
            return
        # vLLM recomputes a failed asynchronous request as soon as it is reported. So report it
        # only after this batch's copies are complete; they may still write into its blocks.
        self._failed_recving -= failed_async
        sync = any(not load.is_async for load, _ in accepted)
        try:
            batch = self.copy_in(
                [load for load, _ in accepted],
                [payload for _, payload in accepted],
                block_compute=sync,
            )
        except Exception as exc:  # noqa: BLE001 - e.g. no device memory: vLLM recomputes
            log.warning("chunkstore: loading %d chunks failed: %s", len(accepted), exc)
            self._abandon_loads([load for load, _ in accepted], leases)
            return
        except BaseException:
            self._settle_device()
            leases.close()
            raise
        assert batch.fence is not None
        self._track(
            _PendingLoad(
                batch.fence, t0, batch.nbytes, leases, len(accepted), ok_reqs, failed_async, checks
            )
        )

    def _abandon_loads(self, loads: list[ChunkLoad], leases: ExitStack) -> None:
        """Handle loads whose copies failed part-way.

        Wait for the copies already issued, then report the loads failed. vLLM
        recomputes an asynchronous request as soon as it is reported.
        """
        self._settle_device()
        leases.close()
        first_of: set[str] = set()
        for load in loads:
            # The chunks are sound. Only each request's first chunk leaves host memory. vLLM's
            # retry then sees a shorter hit, not the same failing copy.
            self._fail(load, drop=load.req_id not in first_of)
            first_of.add(load.req_id)

    def _settle_device(self) -> None:
        if self.copier is not None:
            self.copier.settle()

    def copy_in(self, loads: list[ChunkLoad], payloads: list[Any], *, block_compute: bool) -> Batch:
        """Issue the copies to device and scatters of ``loads`` from chunk ``payloads``.

        This is the device part of a load, without bookkeeping. ``batch.fence``
        says when it is complete. ``tools/gpu_check.py`` times it.
        """
        assert self.copier is not None
        with self.copier.loading(
            payloads, self.read_map, self.torch_dtype, block_compute=block_compute
        ) as batch:
            for load, views in zip(loads, batch.views):
                self._scatter_chunk(load, views)
        return batch

    def copy_out(self, saves: list[ChunkSave], payloads: list[Any]) -> Batch:
        """Issue the gathers and copies to host of ``saves`` into chunk ``payloads``.

        This is the device part of a save, without sealing or storing.
        ``batch.fence`` says when the bytes are in ``payloads``.
        """
        assert self.copier is not None
        with self.copier.saving(payloads, self.write_map, self.torch_dtype) as batch:
            self._gather_chunks(saves, batch.views)
        return batch

    def _open_chunk(
        self, load: ChunkLoad, leases: ExitStack
    ) -> tuple[Any, Callable[[], bool] | None]:
        """The payload of a chunk in host memory and the store's check for it.

        The payload stays pinned until ``leases`` closes. The check runs after
        the copy. It is None when nothing can take the pin back.
        """
        data = leases.enter_context(self.store.read_host(load.key))
        if data is None:
            raise ChunkStoreError("chunk left host memory before it was loaded")
        check = self.store.read_check(data)
        chunk = decode_chunk(
            data,
            verify=self.cfg.verify_host,
            expected_key=load.key.digest,
            expected_fingerprint=self.engine.layout.fingerprint,
        )
        return chunk.payload, check

    def _fail(self, load: ChunkLoad, *, drop: bool = True) -> None:
        """Report ``load`` failed; with ``drop``, also take its chunk out of host memory."""
        self.stats.add("load_errors")
        # The request's first failed chunk leaves host memory. vLLM's retry then sees a
        # shorter hit, not a loop. Later chunks stay for later requests.
        if drop:
            self.store.drop(load.key)
        if load.is_async:
            self._failed_recving.add(load.req_id)
        else:
            for group in load.block_ids:
                self._load_errors.update(b for b in group[load.skip_blocks :] if b)

    def _scatter_chunk(self, load: ChunkLoad, views: dict[str, torch.Tensor]) -> None:
        """Write one chunk's rank part (``views``, on the device) into the request's blocks."""
        copier = self.copier
        assert copier is not None
        bs = self.engine.block_size
        skip = load.skip_blocks
        for name, kv in self.kv_caches.items():
            info = self.engine.layers[name]
            ids = load.block_ids[info.group][skip:]
            keep = [j for j, b in enumerate(ids) if b]  # 0 = null block (sliding window gap)
            if not keep:
                continue
            blocks = copier.index([ids[j] for j in keep])
            layout = self.layouts[name]
            if skip == 0 and len(keep) == self.engine.blocks_per_chunk:
                token_idx = None  # the whole chunk: no selection needed
            else:
                token_idx = copier.index(
                    [t for j in keep for t in range((skip + j) * bs, (skip + j + 1) * bs)]
                )
            if info.kind == MLA:
                k = views[f"layers.{info.layer}.latent"]
                if token_idx is not None:
                    k = k.index_select(0, token_idx)
                layout.scatter(kv, blocks, k, None)
                continue
            k = views[f"layers.{info.layer}.k"]
            v = views[f"layers.{info.layer}.v"]
            if token_idx is not None:
                k, v = k.index_select(1, token_idx), v.index_select(1, token_idx)
            layout.scatter(kv, blocks, k, v)

    # --- saves ----------------------------------------------------------------------

    def wait_for_save(self, meta: ChunkStoreMetadata) -> None:
        self.poll()
        if not meta.saves or not self.kv_caches or self.suspended:
            return
        t0 = time.perf_counter()
        layout = self.engine.layout
        saves = list(meta.saves)
        # Straight into host memory: a pinned slot of this process's cache, or a plain buffer
        # when every slot is pinned. At TP > 1, this rank's ranges of the shared slot.
        wanted = [(s, self._save_slot(s)) for s in saves]
        saves = [s for s, slot in wanted if slot is not None]
        slots = [slot for _, slot in wanted if slot is not None]
        if not slots:
            return  # cached already, a replica rank, or no slot lent out
        payloads = [memoryview(slot.view)[layout.data_offset :] for slot in slots]
        try:
            batch = self.copy_out(saves, payloads)
        except BaseException as exc:
            # What was issued may still write into the slots: wait for it before they go back.
            self._settle_device()
            for slot in slots:
                self.store.save_abandoned(slot)
            if not isinstance(exc, Exception):
                raise
            log.warning("chunkstore: saving %d chunks failed: %s", len(saves), exc)
            self.stats.add("save_errors", len(saves))
            return
        assert batch.fence is not None
        self._track(_PendingSave(batch.fence, t0, batch.nbytes, saves, slots))

    def _save_slot(self, save: ChunkSave) -> Any | None:
        """Host memory for ``save``.

        None means nothing to do, or a failure. A failed save is a future miss.
        """
        try:
            return self.store.save_slot(save)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            log.warning("chunkstore: no host memory for %s: %s", save.key.hex, exc)
            self.stats.add("save_errors")
            return None

    def _gather_chunks(self, saves: list[ChunkSave], views: list[dict[str, torch.Tensor]]) -> None:
        """Copy the saves' blocks, converted to canonical tensors, into each chunk's ``views``."""
        c = self.engine.chunk_tokens
        copier = self.copier
        assert copier is not None
        for name, kv in self.kv_caches.items():
            info = self.engine.layers[name]
            if not info.writer:
                continue
            blocks = copier.index([b for s in saves for b in s.block_ids[info.group]])
            k_all, v_all = self.layouts[name].gather(kv, blocks)
            for j, view in enumerate(views):
                tokens = slice(j * c, (j + 1) * c)
                if info.kind == MLA:
                    view[f"layers.{info.layer}.latent"].copy_(k_all[tokens])
                    continue
                assert v_all is not None
                view[f"layers.{info.layer}.k"].copy_(k_all[:, tokens])
                view[f"layers.{info.layer}.v"].copy_(v_all[:, tokens])

    # --- results -------------------------------------------------------------------

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """The requests that finished and that failed receiving since the last call."""
        self.poll()
        done, failed = self._finished_recving, self._failed_recving
        self._finished_recving, self._failed_recving = set(), set()
        return done, failed

    def take_load_errors(self) -> set[int]:
        """Block ids of synchronous loads that failed this step."""
        self._check_sync_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _check_sync_loads(self) -> None:
        """Finish the batches that hold synchronous loads awaiting their check.

        vLLM takes a failed synchronous load only in the step that loaded it.
        It truncates by that step's tokens. On the device, these copies come
        before the step's forward pass. So this waits at most until the pass
        begins. Batches without such loads are not waited for.
        """
        while any(isinstance(p, _PendingLoad) and p.checks_sync_loads for p in self._pending):
            pending = self._pending.pop(0)
            pending.fence.wait()
            self._finish(pending)

    def take_stats(self) -> dict[str, float] | None:
        """Counters since the last call; None if nothing happened."""
        return self.stats.take()


def _cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str | None:
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(dtype, block_size, head_size))
    except Exception:  # noqa: BLE001 - no CPU backend in this vLLM build
        return None
