"""``ChunkStoreTier``: chunkstore's stores as a secondary tier of vLLM 0.33's OffloadingConnector.

It is one entry in ``TieringOffloadingSpec``'s ``secondary_tiers``::

    {"type": "ChunkStoreTier", "module_path": "chunkstore.vllm.native",
     "tiers": ["file:///mnt/kv"]}

vLLM owns the CPU primary tier. This tier stores what vLLM demotes as
chunk-format v1 files. It loads chunks back into primary slots. It uses the
connector's keys. So the connector and this tier hit each other's chunks. The
CLI works on them too.

All work runs off the scheduler thread. Lookups get ``RETRY`` until a
background existence check returns. Stores and loads run on the tier's
threads. Every store call goes through a
:class:`~chunkstore.tiering._guard.GuardedTier`, with a timeout and back-off.
A tier that is down thus causes misses and failed jobs. It never stalls the
engine. A chunk may fail its checksum or name other tokens. Its load then
fails, and vLLM recomputes it. Its bytes never reach the primary slot.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from chunkstore._threads import started_executor
from chunkstore.backends import Store
from chunkstore.backends._models import record_model
from chunkstore.backends._registry import open_for_option
from chunkstore.backends.base import ReadVerdict, verdict_of
from chunkstore.errors import ConfigError, FormatError
from chunkstore.format import decode_chunk, recompress
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import default_metrics
from chunkstore.tiering import ChunkBuffers, seal_save, tier_open_options
from chunkstore.tiering._guard import GuardedTier
from chunkstore.tiering._tierlist import TierList, TierWrites

# The connector's option parsers: the same words for the same mistakes.
from chunkstore.vllm.config import parse_config, positive_int_option, seconds_option
from chunkstore.vllm.engine import describe_engine
from chunkstore.vllm.native.events import TierEvents
from chunkstore.vllm.native.options import TIER_OPTIONS
from chunkstore.vllm.native.primary import PrimaryLayout
from chunkstore.vllm.native.reading import LoadJobChunk
from chunkstore.vllm.native.requests import (
    ChunkAddress,
    RequestKeys,
    caller_engine,
    caller_request,
)
from chunkstore.vllm.native.writing import ChunkWriting

MAX_TIER_THREADS = 256
"""Most threads one tier may run: the ``threads`` option."""
CALLS_IN_FLIGHT = 8
"""Calls one store runs at once, reads and writes together."""
# With huge-page buffers each chunk is one device request: several in flight keep the disk busy.
IDLE_BUFFER_BYTES = 256 << 20
"""Bytes of chunk buffers the tier keeps mapped between jobs; at least two per thread."""

log = logging.getLogger(__name__)


def _cores() -> int:
    """CPU cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _conversions_at_once(threads: int, cores: int) -> int:
    """How many chunk conversions a tier runs at once.

    A conversion is a gather and a checksum. The count is one fewer than
    ``cores``, at least one, and at most ``threads``. The core left over starts
    the writes that keep the disk busy.
    """
    return max(1, min(threads, cores - 1))


__all__ = ["ChunkStoreTier"]


def _store_options(url: str, store_options: Any) -> dict[str, Any]:
    """Options to open the tier at ``url`` with: the user's ``store_options``.

    A local directory also gets ``write_mode="direct"``, unless the options
    say otherwise. vLLM demotes chunks here because host memory is full.
    Writing them through the page cache would only push other pages out.
    vLLM's own fs tier writes with O_DIRECT too. Reads still pick cached or
    direct per file.
    """
    options = tier_open_options(url, dict(store_options.get(url, {})))
    if "://" not in url or url.startswith("file://"):
        options.setdefault("write_mode", "direct")
    return options


class ChunkStoreTier(SecondaryTierManager):
    """A vLLM secondary tier backed by chunkstore stores; the module docstring has the rules."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        unknown = sorted(set(options) - set(TIER_OPTIONS))
        if unknown:
            raise ConfigError(
                f"chunkstore tier: unknown option(s) {', '.join(map(repr, unknown))}; "
                f"valid options: {', '.join(sorted(TIER_OPTIONS))}"
            )
        if "tiers" not in options:
            raise ConfigError("chunkstore tier: 'tiers' is required (a store URL or a list)")
        if "locality" in options:
            try:
                self.locality = Locality(options["locality"])
            except ValueError:
                raise ConfigError(
                    f"chunkstore tier: locality must be 'LOCAL' or 'REMOTE', got "
                    f"{options['locality']!r}"
                ) from None
        found = caller_engine()
        if found is None:
            raise ConfigError(
                "chunkstore tier: the engine's configuration is not on the call stack; the "
                "tier must be built by vLLM's OffloadingConnector (TieringOffloadingSpec)"
            )
        vllm_config, kv_cache_config = found
        config = offloading_spec.config
        if config.parallel.world_size != config.parallel.tp_size:
            raise ConfigError("chunkstore tier: only tensor parallelism is supported (no PP/DP)")
        if config.canonical_layout or config.replicated_layout:
            raise ConfigError(
                "chunkstore tier: remove canonical_layout from kv_connector_extra_config "
                "(the tier converts vLLM's direct layout itself)"
            )
        threads = positive_int_option(options.get("threads", 4), "threads", MAX_TIER_THREADS)
        timeout = seconds_option(options, "tier_timeout", 30.0)
        retry_after = seconds_option(options, "retry_after", 5.0)
        if timeout <= 0:
            raise ConfigError(f"tier_timeout: must be positive, got {timeout}")
        block_size = int(config.groups[0].tokens_per_block) if config.groups else 0
        shared = ("tiers", "store_options", "compression", "model_id", "namespace")
        cfg = parse_config(
            {
                **{k: options[k] for k in shared if k in options},
                "blocks_per_chunk": int(offloading_spec.blocks_per_chunk),
            },
            block_size=max(block_size, 1),
        )
        self.engine = describe_engine(vllm_config, kv_cache_config, cfg)
        self.primary = PrimaryLayout(
            self.engine,
            tp_size=config.parallel.tp_size,
            blocks_per_chunk=int(offloading_spec.blocks_per_chunk),
            kv_cache_layout=config.kv_cache_layout,
            layer_order=config.groups[0].layer_names if config.groups else (),
            slot_bytes=self.block_size_bytes,
        )
        self.compression = cfg.compression
        self.keys = RequestKeys(
            self.engine,
            tokens_per_hash=int(config.cache.tokens_per_hash),
            block_hash_of=get_offload_block_hash,
        )
        self._flat = memoryview(primary_kv_view).cast("B")
        metrics = default_metrics()
        self.stores: list[Store] = []
        guarded: list[GuardedTier] = []
        try:
            for url in cfg.tiers:
                store = open_for_option("tiers", url, **_store_options(url, cfg.store_options))
                self.stores.append(store)
                metrics.watch_store(store)
                # Started whole, so the first writes wait for no thread start.
                guarded.append(
                    GuardedTier(
                        store,
                        metrics.tier(store.name),
                        timeout=timeout,
                        retry_after=retry_after,
                        workers=CALLS_IN_FLIGHT,
                        start_workers=True,
                    )
                )
        except BaseException:
            self.tiers = TierList(guarded)
            self._close_stores()
            raise
        self.tiers = TierList(guarded)
        """The stores, each behind its guard, in the order they are read."""
        for store in self.stores:
            record_model(store, self.engine.spec)  # so `chunkstore inspect` names the model
        layout = self.primary.layout
        # Room for a zstd chunk of incompressible KV, a little larger than the raw one. The
        # idle buffers kept cover every thread's job of a few chunks, within IDLE_BUFFER_BYTES.
        size = layout.total_size + layout.total_size // 64 + 65536
        # Each chunk's payload starts on a huge-page boundary, where the kernel gives huge
        # pages. O_DIRECT then moves it in fewer device requests; see ChunkBuffers.
        self._buffers = ChunkBuffers(
            size, keep=max(2 * threads, IDLE_BUFFER_BYTES // size), huge_at=layout.data_offset
        )
        # Started whole, as vLLM's own tiers start theirs: the first jobs wait for no thread.
        self._pool = started_executor(threads, "chunkstore-tier")
        self.max_converting = _conversions_at_once(threads, _cores())
        """Most conversions at once, from :func:`_conversions_at_once`."""
        self._converting = threading.BoundedSemaphore(self.max_converting)
        self.max_writing = 2 * CALLS_IN_FLIGHT
        """Most converted chunks whose writes are neither ended nor settled."""
        # Enough for every guard thread to find its next write queued when one ends. It also
        # bounds the buffers a burst of stores holds. A call's timeout counts from when it is
        # queued, so a longer queue would time out a slow but healthy store and put it in
        # back-off, however many cores the host has.
        self._writing = threading.BoundedSemaphore(self.max_writing)
        self.max_reading = 2 * CALLS_IN_FLIGHT
        """Most chunk reads started and not yet scattered; the same bound as writes."""
        self._reading = threading.BoundedSemaphore(self.max_reading)
        try:
            self._buffers.reserve(self.max_writing + self.max_reading)
        except BaseException:  # no memory for them: the threads and stores opened go too
            self._pool.shutdown(wait=True)
            self._buffers.close()
            self._close_stores()
            raise
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="chunkstore-tier-lookup")
        self._jobs: dict[int, Future[None]] = {}
        self._loads: dict[int, tuple[str, list[ChunkKey]]] = {}
        self._stores: dict[int, tuple[str, list[ChunkKey]]] = {}
        self.events: TierEvents | None = None
        """BlockStored events of finished store jobs, or None when events are off."""
        # Set only when enable_kv_events and vLLM's KV events are both on.
        if (
            options.get("enable_kv_events")
            and offloading_spec.kv_events_config.enable_kv_cache_events
        ):
            self.events = TierEvents(locality=self.locality, ownership=tier_type)
        self._finished: deque[JobResult] = deque()
        self._verdicts: dict[str, dict[ChunkKey, bool | Future[bool]]] = {}
        self.corrupt = 0
        """Number of chunks that failed verification on load."""
        log.info(
            "chunkstore tier: model %s, %d-token chunks, stores %s",
            self.engine.spec.model_id,
            self.engine.chunk_tokens,
            list(cfg.tiers),
        )

    # --- requests -----------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        request = caller_request(req_context.req_id)
        if request is not None:
            self.keys.track(req_context.req_id, request)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.keys.forget(req_context.req_id)
        self._verdicts.pop(req_context.req_id, None)

    def _address(self, key: OffloadKey, req_context: ReqContext) -> ChunkAddress | None:
        if get_offload_group_idx(key) != 0:
            return None
        end = req_context.get_offload_key_position(key)
        return self.keys.address(req_context.req_id, key, end)

    # --- lookups --------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        address = self._address(key, req_context)
        if address is None:
            return LookupResult.MISS
        verdicts = self._verdicts.setdefault(req_context.req_id, {})
        verdict = verdicts.get(address.key)
        if verdict is None:
            verdicts[address.key] = self._lookup_pool.submit(self._held, address.key)
            return LookupResult.RETRY
        if isinstance(verdict, Future):
            if not verdict.done():
                return LookupResult.RETRY
            verdict = verdicts[address.key] = verdict.result()
        return LookupResult.HIT if verdict else LookupResult.MISS

    def _held(self, key: ChunkKey) -> bool:
        """Whether some store holds ``key``; a store that is down answers no."""
        return self.tiers.exists_many([key], count=True)[0]

    # --- stores ---------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        ctx = job_metadata.req_context
        addresses = [self._address(k, ctx) for k in job_metadata.keys]
        slots = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        self._stores[job_id] = (ctx.req_id, [a.key for a in addresses if a is not None])
        if self.events is not None:
            self.events.submitted(job_id, job_metadata.keys)
        self._jobs[job_id] = self._pool.submit(self._run_store, job_id, addresses, slots)

    def _slot(self, chunk_id: int) -> memoryview:
        size = self.block_size_bytes
        return self._flat[chunk_id * size : (chunk_id + 1) * size]

    def _run_store(
        self, job_id: int, addresses: list[ChunkAddress | None], slots: list[int]
    ) -> None:
        t0 = time.perf_counter()
        ok = all(a is not None for a in addresses)
        nbytes = 0
        # This thread converts the job's chunks one after another. Each chunk's writes start
        # on the stores' guard threads once it is sealed. So this thread converts chunk i+1
        # while chunk i is on the disk. The disk gets the next write without waiting for a
        # thread to wake. Results are taken in order.
        started: deque[ChunkWriting] = deque()
        try:
            try:
                for address, slot in zip(addresses, slots):
                    if address is None:
                        continue  # no tokens for this key: not stored (a future miss)
                    # A chunk starts only with a permit of the tier's bound. A job that holds
                    # permits settles its own oldest chunk. It does not wait for other jobs,
                    # which could wait for its permits in turn. A job with no permit waits.
                    while not self._writing.acquire(blocking=not started):
                        stored, size = self._settle(started.popleft())
                        ok, nbytes = ok and stored, nbytes + size
                    writing = self._start_chunk(job_id, address, slot)
                    if writing is None:
                        ok = False
                    else:
                        started.append(writing)
            finally:
                while started:
                    stored, size = self._settle(started.popleft())
                    ok, nbytes = ok and stored, nbytes + size
        except Exception:  # noqa: BLE001 - a failed store is a future miss
            log.exception("chunkstore tier: store job %d failed", job_id)
            ok = False
        finally:
            # Every submitted job is reported, whatever happened. vLLM's drain_jobs waits for
            # each result, and reset_cache asserts that none is left.
            self._finished.append(JobResult(job_id, ok, None, time.perf_counter() - t0, nbytes))

    def _start_chunk(self, job_id: int, address: ChunkAddress, slot: int) -> ChunkWriting | None:
        """Convert the primary ``slot`` into ``address``'s chunk and start its writes.

        Every store gets a write. The caller holds a permit of ``_writing``. The
        permit passes to the result. Returns None when the chunk could not be
        made. The permit is then given back.
        """
        layout = self.primary.layout
        try:
            (buffer,) = self._buffers.take(1)
        except Exception:  # noqa: BLE001 - no buffer (mapping failed): a future miss
            log.exception("chunkstore tier: store job %d failed", job_id)
            self._writing.release()
            return None
        writing = ChunkWriting(self._writing.release, lambda: self._buffers.give([buffer]))
        try:
            view = memoryview(buffer)[: layout.total_size]
            with self._converting:
                self.primary.to_payload(self._slot(slot), view[layout.data_offset :])
                seal_save(layout, view, address)
            data = recompress(view, "zstd") if self.compression == "zstd" else view
            writing.writes = TierWrites(1, len(data), if_absent=True)
            self.tiers.start_writes(writing.writes, [(address.key, data)])
            writing.all_started()
            return writing
        except Exception:  # noqa: BLE001 - a failed store is a future miss
            log.exception("chunkstore tier: store job %d failed", job_id)
            writing.release()
            # A write already started ends on its own; its result is not needed. The buffer
            # goes back once nothing reads it any more.
            self._buffers.release_after(writing.futures(), [buffer])
            return None

    def _settle(self, writing: ChunkWriting) -> tuple[bool, int]:
        """Wait for a started chunk's writes.

        Returns whether every store took the chunk, and the bytes written.
        """
        try:
            assert writing.writes is not None
            settled = writing.writes.settle()
        finally:
            writing.release()
        return all(written is not None for _, written, _ in settled), writing.writes.nbytes

    # --- loads ----------------------------------------------------------------------

    def submit_load(self, job_metadata: TransferJob) -> None:
        ctx = job_metadata.req_context
        keys = list(job_metadata.keys)
        addresses = [self._address(k, ctx) for k in keys]
        slots = [int(c) for c in job_metadata.chunk_ids]
        job_id = job_metadata.job_id
        self._loads[job_id] = (ctx.req_id, [a.key for a in addresses if a is not None])
        self._jobs[job_id] = self._pool.submit(self._run_load, job_id, keys, addresses, slots)

    def _run_load(
        self,
        job_id: int,
        keys: list[OffloadKey],
        addresses: list[ChunkAddress | None],
        slots: list[int],
    ) -> None:
        t0 = time.perf_counter()
        loaded = 0
        # Loads are pipelined like stores. The job's reads and the stores' checksum checks
        # run ahead on the stores' guard threads. Meanwhile this thread scatters the chunks
        # that came back into their slots, in order. A read starts only with a permit of the
        # tier's bound. A job with no permit waits for one. A job with permits starts no more
        # than are free. So reads in flight, and the buffers they fill, stay bounded. A load
        # fills a prefix of its keys. It ends at the first chunk no store has. Reads started
        # past that chunk are dropped, and their slots are never written.
        wanted = next((i for i, a in enumerate(addresses) if a is None), len(addresses))
        started: deque[LoadJobChunk | None] = deque()
        try:
            try:
                for index, slot in enumerate(slots[:wanted]):
                    ahead = index + len(started)
                    while ahead < wanted and self._reading.acquire(blocking=not started):
                        started.append(self._start_load(job_id, addresses[ahead]))
                        ahead += 1
                    load = started.popleft()
                    if load is None:
                        break
                    payload = self._finish_load(job_id, load)
                    scattered = payload is not None and self._scatter(job_id, payload, slot)
                    load.close()
                    if not scattered:
                        break
                    loaded += 1
            finally:
                for load in started:
                    if load is not None:
                        load.close()
        except Exception:  # noqa: BLE001 - a failed load is recomputed by vLLM
            log.exception("chunkstore tier: load job %d failed", job_id)
        finally:
            # Reported whatever happened, as stores are (the chunks scattered are kept).
            ok = loaded == len(keys)
            kept = tuple(keys[:loaded]) if not ok and loaded else None
            nbytes = loaded * self.block_size_bytes
            self._finished.append(JobResult(job_id, ok, kept, time.perf_counter() - t0, nbytes))

    def _start_load(self, job_id: int, address: ChunkAddress | None) -> LoadJobChunk | None:
        """Start reading ``address``'s chunk from the first store that takes calls.

        The caller holds a permit of ``_reading``. The permit passes to the
        result. Returns None when the read could not start. The permit is then
        given back.
        """
        if address is None:
            self._reading.release()
            return None
        try:
            load = LoadJobChunk(address.key, self._buffers, self._reading.release)
        except Exception:  # noqa: BLE001 - no buffer: a failed load, recomputed by vLLM
            log.exception("chunkstore tier: load job %d failed", job_id)
            self._reading.release()
            return None
        try:
            load.read = self.tiers.start_read([load.key], load.buffers, [0])
        except Exception:  # noqa: BLE001 - a failed load is recomputed by vLLM
            log.exception("chunkstore tier: load job %d failed", job_id)
            load.close()
            return None
        return load

    def _finish_load(self, job_id: int, load: LoadJobChunk) -> Any | None:
        """The verified payload of a started load; None when no store has one.

        If the first store has no good copy, the later stores are asked.
        """
        try:
            (payload,) = self.tiers.finish_read(
                [load.key],
                load.buffers,
                load.read,
                judge=self._payload,
                pending=load.pending,
                fresh=partial(self._move_off, load.buffers),
            )
        except Exception:  # noqa: BLE001 - a failed load is recomputed by vLLM
            log.exception("chunkstore tier: load job %d failed", job_id)
            return None
        finally:
            load.read = None  # settled: its call is done, or in pending
        return payload

    def _scatter(self, job_id: int, payload: Any, slot: int) -> bool:
        """Write a verified payload into the primary ``slot``; False if that failed."""
        try:
            self.primary.from_payload(payload, self._slot(slot))
        except Exception:  # noqa: BLE001 - a failed load is recomputed by vLLM
            log.exception("chunkstore tier: load job %d failed", job_id)
            return False
        return True

    def _move_off(self, buffers: list[Any], asked: list[int], running: Future[Any]) -> bool:
        """Give the keys at ``asked`` fresh buffers, because a timed-out read still runs.

        The late call may still write into the old buffers. The next store's
        bytes must land elsewhere. They are verified as they are read. Bytes
        written over them later would reach the primary slot unchecked. The old
        buffers go back once the call ends. Returns False when no buffer is
        free. The load then reads no more.
        """
        try:
            fresh = self._buffers.take(len(asked))
        except Exception:  # noqa: BLE001 - no memory: the keys stay missing (recomputed)
            log.exception("chunkstore tier: no buffer for the next store's read")
            return False
        old = [buffers[i] for i in asked]
        for i, buffer in zip(asked, fresh):
            buffers[i] = buffer
        self._buffers.release_after([running], old)
        return True

    def _payload(self, tier: GuardedTier, key: ChunkKey, data: Any, verified: bool) -> Any | None:
        """``data``'s payload if it is ``key``'s chunk for this model.

        If the store ``verified`` the read, its check covered the checksum.
        Structure and identity are checked here in any case.
        """
        try:
            chunk = decode_chunk(
                data,
                verify=not verified,
                expected_key=key.digest,
                expected_fingerprint=self.primary.layout.fingerprint,
            )
        except FormatError as exc:
            # A newer writer's chunk or another model's is a plain miss; only damage is reported.
            if verdict_of(exc) is ReadVerdict.CORRUPT:
                self.corrupt += 1
                # The store's set-aside runs on the store's guard, not on this job's thread. It
                # may be a rename on a mount or requests to S3 or a peer. A store that stalls in it
                # must not hold a load job and its permits past the store's timeout.
                with tier.handing_off_set_asides():
                    tier.store.report_corrupt(key, exc)
            return None
        return chunk.payload

    # --- completion -----------------------------------------------------------------

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while self._finished:
            result = self._finished.popleft()
            self._jobs.pop(result.job_id, None)
            load = self._loads.pop(result.job_id, None)
            if load is not None and not result.success:
                req_id, keys = load
                kept = len(result.successful_keys or ())
                # Recomputed by vLLM: not looked up again for this request.
                self._remember(req_id, keys[kept:], False)
            store = self._stores.pop(result.job_id, None)
            if store is not None and result.success:
                self._remember(*store, True)  # a later lookup of this request finds them
            if store is not None and self.events is not None:
                self.events.finished(result.job_id, result.success)
            results.append(result)
        return results

    def take_events(self) -> Iterable[Any]:
        # vLLM's OffloadingConnector publishes them as BlockStored under its block hashes.
        return self.events.take() if self.events is not None else ()

    def _remember(self, req_id: str, keys: Sequence[ChunkKey], held: bool) -> None:
        verdicts = self._verdicts.get(req_id)
        if verdicts is not None:
            for key in keys:
                verdicts[key] = held

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or any(
            isinstance(v, Future) for verdicts in self._verdicts.values() for v in verdicts.values()
        )

    def drain_jobs(self) -> None:
        wait(list(self._jobs.values()))

    def shutdown(self) -> None:
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        self._lookup_pool.shutdown(wait=True, cancel_futures=True)
        self._close_stores()
        self._buffers.close()

    def _close_stores(self) -> None:
        for tier in self.tiers:
            tier.close()
        for store in self.stores:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - closing is best effort at shutdown
                log.exception("chunkstore tier: closing %s failed", store.name)
        self.tiers, self.stores = TierList(()), []
