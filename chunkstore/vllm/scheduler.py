"""The scheduler side: chunk keys, lookups in host then tiers, load and save plans.

Rules, from issue 6 and DESIGN.md:

* Device blocks are claimed only for chunks already in host memory. A chunk
  that only a secondary tier holds is first prefetched into host memory.
  Meanwhile vLLM gets ``None``, which means "ask again later". A prefetch may
  fail or run past ``prefetch_timeout_s``. It then becomes a shorter hit or a
  miss.
* Hits are whole chunks, and never the whole prompt. vLLM must compute at
  least one token to sample from.
* Saves are planned for full chunks only. The plan comes in the step whose
  forward pass completes the chunk. The worker copies it out in that step's
  ``wait_for_save``. So block freeing never waits for a save.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from chunkstore.hashing import ChunkKey
from chunkstore.node import NodeCache
from chunkstore.tiering import PrefetchResult, ProcessCache
from chunkstore.vllm.config import ConnectorConfig
from chunkstore.vllm.counters import Counters
from chunkstore.vllm.engine import EngineKV
from chunkstore.vllm.events import ConnectorEvents
from chunkstore.vllm.metadata import ChunkLoad, ChunkSave, ChunkStoreMetadata

log = logging.getLogger(__name__)

__all__ = ["ChunkStoreScheduler"]

_NULL_BLOCK = 0
"""The null block, which vLLM's block pool reserves for skipped sliding-window slots."""

_TIER_SOURCES = {"peer": CacheHitSource.P2P}
"""Tier kinds that vLLM's hit-source metric does not count as DISK."""
_HOST_SOURCE = "host"
_PREFETCH_POLL_S = 0.002
"""Longest wait on an in-flight prefetch per lookup, before the answer "later"."""


@dataclass
class _Request:
    """What the scheduler connector tracks per live request."""

    request: Any
    root: bytes
    keys: list[ChunkKey] = field(default_factory=list)
    saved: int = 0
    """Index of the first chunk not yet stored or planned; saves continue from here."""
    prefetch: Future[PrefetchResult] | None = None
    prefetch_from: int = 0
    prefetch_deadline: float = 0.0
    prefetch_done: bool = False
    tier_sources: dict[int, str] = field(default_factory=dict)
    """Map from chunk index to the tier kind it was prefetched from."""
    hit: tuple[int, int, int] | None = None
    """The last lookup's hit: first chunk, end chunk and locally computed tokens."""
    sources: dict[CacheHitSource, int] = field(default_factory=dict)


class ChunkStoreScheduler:
    """The scheduler-role half of :class:`~chunkstore.vllm.ChunkStoreConnector`."""

    def __init__(
        self, engine: EngineKV, cfg: ConnectorConfig, store: ProcessCache | NodeCache
    ) -> None:
        self.engine = engine
        self.cfg = cfg
        self.store = store
        self.kv_cache_manager: Any = None
        self._reqs: dict[str, _Request] = {}
        self._loads: dict[str, list[ChunkLoad]] = {}
        self.stats = Counters()
        self.events: ConnectorEvents | None = None
        """The KV events, told which vLLM blocks each saved or prefetched chunk stands for."""
        # None unless KV events are on.

    # --- keys ------------------------------------------------------------------

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _Request(request, self.engine.root_of(request))
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _Request, num_tokens: int) -> list[ChunkKey]:
        """Keys of the first ``num_tokens // chunk_tokens`` chunks, extending the chain."""
        c = self.engine.chunk_tokens
        tokens = st.request.all_token_ids
        # Never past the known tokens. A key for a chunk with a missing token would be
        # wrong, and it stays cached for the rest of the request.
        want = min(num_tokens, len(tokens)) // c
        if want > len(st.keys):
            after = st.keys[-1] if st.keys else None
            st.keys += self.engine.keys(list(tokens[len(st.keys) * c : want * c]), st.root, after)
        return st.keys[:want]

    # --- lookups ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if _has_prompt_embeds(request):
            # Embedded positions read as token 0. Keys of token ids alone would give two
            # prompts one key. Such requests neither load nor save.
            return 0, False
        st = self._state(request)  # (also when loads are off: saves start from it)
        if not self.cfg.load:
            return 0, False
        c = self.engine.chunk_tokens
        # Leave at least one token to compute: vLLM samples from the last prompt position.
        keys = self._keys(st, max(request.num_tokens - 1, 0))
        start = num_computed_tokens // c
        st.hit = None
        if start >= len(keys):
            return 0, False
        end = self.store.host_run(keys, start)
        if st.prefetch is not None:
            if not st.prefetch.done() and time.monotonic() < st.prefetch_deadline:
                # Yield the GIL for a moment. An idle engine loop that asks again at once
                # would starve the prefetch thread it waits for.
                wait([st.prefetch], timeout=_PREFETCH_POLL_S)
            if not st.prefetch.done() and time.monotonic() < st.prefetch_deadline:
                return None, False
            self._finish_prefetch(st)
            end = self.store.host_run(keys, start)
        elif end < len(keys) and self.store.tiers and not st.prefetch_done:
            if self.store.tiers_are_fast and self.store.tier_prefix(keys[end:]) == 0:
                # A local lookup says miss, so vLLM need not wait.
                st.prefetch_done = True
                return self._hit(st, start, end, num_computed_tokens)
            # Device blocks only for chunks already in host memory: fetch first, ask later.
            if self.events is not None:
                self.events.remember(request, end, keys[end:])
            st.prefetch = self.store.submit_prefetch(keys[end:])
            st.prefetch_from = end
            st.prefetch_deadline = time.monotonic() + self.cfg.prefetch_timeout_s
            return None, False
        return self._hit(st, start, end, num_computed_tokens)

    def _hit(
        self, st: _Request, start: int, end: int, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Record chunks ``start`` to ``end`` as the request's hit.

        Returns vLLM's ``(tokens, async)`` pair. ``end`` is exclusive.
        """
        c = self.engine.chunk_tokens
        self.stats.add("lookups")
        if end <= start:
            return 0, False
        hit_tokens = end * c - num_computed_tokens
        if hit_tokens <= 0:
            return 0, False
        st.hit = (start, end, num_computed_tokens)
        sources: dict[CacheHitSource, int] = {}
        host_chunks = tier_chunks = 0
        for i in range(start, end):
            tier = st.tier_sources.get(i)
            source = (
                CacheHitSource.HOST
                if tier is None
                else _TIER_SOURCES.get(tier, CacheHitSource.DISK)
            )
            tokens = c - (num_computed_tokens - i * c if i == start else 0)
            sources[source] = sources.get(source, 0) + tokens
            if tier is None:
                host_chunks += 1
            else:
                tier_chunks += 1
        st.sources = sources
        self.stats.add("hit_chunks_host", host_chunks)
        self.stats.add("hit_chunks_tier", tier_chunks)
        return hit_tokens, self.engine.num_groups > 1

    def _finish_prefetch(self, st: _Request) -> None:
        future, st.prefetch, st.prefetch_done = st.prefetch, None, True
        assert future is not None
        if not future.done():
            self.stats.add("prefetch_timeouts")
            log.info(
                "chunkstore: prefetch for %s timed out; using what arrived", st.request.request_id
            )
            return
        try:
            result = future.result()
        except Exception as exc:  # noqa: BLE001 - a failed prefetch is a miss
            log.warning("chunkstore: prefetch for %s failed: %s", st.request.request_id, exc)
            return
        self.stats.add("corrupt_chunks", result.corrupt)
        for j, kind in enumerate(result.sources):
            if kind != _HOST_SOURCE:  # already in host memory: counted as a host hit
                st.tier_sources[st.prefetch_from + j] = kind

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        st = self._reqs.get(request.request_id)
        if not num_external_tokens or st is None or not st.sources:
            return {}
        if sum(st.sources.values()) != num_external_tokens:
            return {CacheHitSource.outermost(st.sources): num_external_tokens}
        return dict(st.sources)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if num_external_tokens <= 0 or st is None or st.hit is None:
            return
        start, end, local = st.hit
        c, bs, bpc = self.engine.chunk_tokens, self.engine.block_size, self.engine.blocks_per_chunk
        if local + num_external_tokens != end * c:
            # vLLM trimmed the hit (e.g. a local partial block won); load the chunks it kept.
            end = (local + num_external_tokens) // c
        block_ids = blocks.get_block_ids()
        is_async = self.engine.num_groups > 1
        loads = []
        for i in range(start, end):
            per_group = tuple(tuple(g[i * bpc : (i + 1) * bpc]) for g in block_ids)
            skip = max(0, local // bs - i * bpc)
            loads.append(ChunkLoad(request.request_id, st.keys[i], per_group, skip, is_async))
        self._loads[request.request_id] = loads
        # Chunks that came from the store need no save.
        st.saved = max(st.saved, end)
        st.hit = None

    # --- plans ------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> ChunkStoreMetadata:
        meta = ChunkStoreMetadata()
        for req_id, loads in self._loads.items():
            meta.loads.extend(loads)
            if loads and loads[0].is_async:
                meta.async_load_reqs.add(req_id)
        self._loads.clear()
        if not self.cfg.save or self.kv_cache_manager is None:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_saves(
                meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0)
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_saves(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_saves(self, meta: ChunkStoreMetadata, req_id: str, computed: int) -> None:
        st = self._reqs.get(req_id)
        if st is None:
            return
        request = st.request
        # With asynchronous scheduling, last step's sampled token is still a placeholder
        # here. A chunk is saved once all its tokens are known, a step later.
        computed = min(computed, len(request.all_token_ids))
        if not self.cfg.save_decode:
            computed = min(computed, request.num_prompt_tokens)
        c, bpc = self.engine.chunk_tokens, self.engine.blocks_per_chunk
        full = computed // c
        if full <= st.saved:
            return
        keys = self._keys(st, full * c)
        block_ids = self.kv_cache_manager.get_block_ids(req_id)
        tokens = request.all_token_ids
        for i in range(st.saved, full):
            if self.store.host.contains(keys[i]):
                continue
            per_group = tuple(tuple(g[i * bpc : (i + 1) * bpc]) for g in block_ids)
            if any(len(g) != bpc or _NULL_BLOCK in g for g in per_group):
                # A sliding-window group already dropped these blocks: the chunk cannot be whole.
                continue
            parent = keys[i - 1].digest if i else st.root
            meta.saves.append(
                ChunkSave(req_id, keys[i], parent, tuple(tokens[i * c : (i + 1) * c]), per_group)
            )
            if self.events is not None:
                self.events.remember(request, i, keys[i : i + 1])
        st.saved = full

    # --- lifecycle --------------------------------------------------------------

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    def reset_cache(self) -> bool:
        self.store.reset_host()
        for st in self._reqs.values():
            st.saved = 0
        return True

    def take_stats(self) -> dict[str, float] | None:
        """Counters since the last call; None if nothing happened."""
        return self.stats.take()


def _has_prompt_embeds(request: Any) -> bool:
    """Whether some prompt positions are embeddings, from ``--enable-prompt-embeds``."""
    return getattr(request, "prompt_embeds", None) is not None
