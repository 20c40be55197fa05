"""ChunkStoreConnector under vLLM's real Scheduler (no engine): hits, misses, failures, hybrid."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402
from vllm.v1.request import FinishReason, RequestStatus  # noqa: E402

from chunkstore.backends import MemoryStore  # noqa: E402
from chunkstore.tiering import ProcessCache  # noqa: E402
from chunkstore.vllm.shared import acquire_shared, release_shared
from chunkstore.vllm.testing import sample_prompt_ids  # noqa: E402

from .harness import harnesses  # noqa: E402

PROMPT = sample_prompt_ids(300, seed=1)  # 4 full chunks of 64, plus 44 tokens


@pytest.fixture
def harness(tiny_model):
    with harnesses(tiny_model) as make:
        yield make


@contextlib.contextmanager
def _gone():
    """``read_host`` of a chunk that left host memory between lookup and load."""
    yield None


class _Hits:
    def __init__(self, h):
        self.hits, self.hits_by_source, self.preempted_hits = h.external_hits()


def external_hits(h):
    return _Hits(h)


def test_miss_saves_full_chunks_then_hit_loads_exact_kv(harness):
    h = harness()
    first = h.add(PROMPT)
    h.run()
    store = h.connector.store
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    assert len(keys) == 4 and all(store.host.contains(k) for k in keys)

    assert h.scheduler.reset_prefix_cache()
    second = h.add(PROMPT)
    out = h.step()
    assert out.has_sync_kv_loads
    assert h.scheduler.requests[second.request_id].num_computed_tokens == 300
    assert h.device_kv_matches(second, 256)
    stats = external_hits(h)
    assert stats.hits == 256
    assert stats.hits_by_source == {CacheHitSource.HOST: 256}
    h.run()
    assert first.request_id in h.finished and second.request_id in h.finished


def test_partial_hit_and_local_prefix(harness):
    h = harness()
    h.add(PROMPT[:200])  # 3 full chunks saved
    h.run()
    h.scheduler.reset_prefix_cache()
    # Shares 150 tokens (2 full chunks) with the first prompt.
    other = PROMPT[:150] + sample_prompt_ids(100, seed=9)
    req = h.add(other)
    h.step()
    assert external_hits(h).hits == 128
    assert h.device_kv_matches(req, 128)
    h.run()
    # Same prompt again without reset: vLLM's own prefix cache covers it, nothing external.
    h.add(other)
    h.step()
    assert external_hits(h).hits == 0


def test_save_decode_chunks_for_next_turn(harness):
    h = harness()
    req = h.add(PROMPT[:100], max_tokens=40)  # 100 + 40 tokens -> 2 full chunks
    h.run()
    turn = list(req.all_token_ids)
    keys = h.connector.engine.keys(turn[:128], h.connector.engine.root())
    assert all(h.connector.store.host.contains(k) for k in keys)


class SlowStore(MemoryStore):
    """A memory tier whose reads wait for a gate (to observe "ask again later")."""

    def __init__(self):
        super().__init__(name="slow")
        self.gate = threading.Event()

    def _read_many(self, keys):
        self.gate.wait(10)
        return super()._read_many(keys)


def _tier_harness(harness, tier, **extra):
    """A harness whose connector store has ``tier`` as its secondary tier."""
    h = harness(extra=extra)
    old = h.connector.store
    name = h.connector.pool_name
    connectors = (h.connector, h.worker)
    for _ in connectors:  # both connectors let go of the old store: it closes
        release_shared(name)
    for _ in connectors:  # and hold the new one (their shutdown releases it)
        store = acquire_shared(
            name,
            lambda: ProcessCache(
                host_bytes=old.host.cache.capacity_bytes,
                layout=h.connector.engine.layout,
                stores=[tier],
            ),
        )
    for holder in (h.connector, h.connector.scheduler, h.worker, h.worker.worker):
        holder.store = store
    return h


def _step_until_scheduled(h):
    """Step until a step schedules tokens (a request waits while its tier hit is read); that
    step's output (the last one after 200 steps)."""
    for _ in range(200):
        out = h.step()
        if out.num_scheduled_tokens:
            break
        time.sleep(0.01)
    return out


def test_tier_hit_is_prefetched_before_blocks_are_allocated(harness):
    tier = SlowStore()
    h = _tier_harness(harness, tier)
    h.add(PROMPT)
    h.run()
    h.connector.store.flush()
    assert len(list(tier.list())) == 4
    h.connector.store.reset_host()
    h.scheduler.reset_prefix_cache()

    req = h.add(PROMPT)
    out = h.step()
    assert out.num_scheduled_tokens == {}  # asked again later: no blocks claimed yet
    assert h.scheduler.requests[req.request_id].num_computed_tokens == 0
    assert h.scheduler.kv_cache_manager.get_block_ids(req.request_id) == ([],)
    tier.gate.set()
    _step_until_scheduled(h)
    stats = external_hits(h)
    assert stats.hits == 256
    assert stats.hits_by_source == {CacheHitSource.DISK: 256}
    assert h.device_kv_matches(req, 256)


def test_prefetch_timeout_becomes_a_shorter_hit(harness):
    tier = SlowStore()
    h = _tier_harness(harness, tier, prefetch_timeout_s=0.05)
    h.add(PROMPT)
    h.run()
    h.connector.store.flush()
    h.connector.store.reset_host()
    h.scheduler.reset_prefix_cache()
    req = h.add(PROMPT)
    out = _step_until_scheduled(h)
    assert out.num_scheduled_tokens == {req.request_id: 300}
    assert external_hits(h).hits == 0  # nothing arrived in time: a miss, computed normally
    tier.gate.set()


def _sealed_with_a_mac_and_compressed(spec, data):
    """An engine's plain chunk ``data`` as a writer holding a MAC key keeps it on a cold tier:
    sealed with a MAC, then zstd-compressed (the MAC kept)."""
    import numpy as np

    from chunkstore.format import ChunkLayout, decode_chunk, encode_chunk, recompress

    mac_key = b"q" * 32
    chunk = decode_chunk(data)
    header = chunk.header
    sealed = encode_chunk(
        ChunkLayout(spec, authenticated=True),
        key=header.key,
        parent=header.parent,
        namespace=header.namespace,
        tokens=np.frombuffer(header.token_bytes, dtype=np.uint32),
        tensors={t.name: chunk.tensor(t.name) for t in header.tensors},
        mac_key=mac_key,
    )
    packed = recompress(sealed, "zstd", mac_key=mac_key)
    assert len(packed) < len(data)  # (it fits a slot of the engine's layout)
    return packed


def test_a_compressed_chunk_with_a_mac_loads_exact_kv_from_host_memory(harness):
    """Host memory keeps a zstd chunk that carries a MAC compressed (decompressing it without
    the key would drop the MAC): the worker's load decodes what it pins there, so such chunks
    load the same KV as plain ones."""
    from chunkstore.format import read_header

    tier = MemoryStore(name="cold")
    h = _tier_harness(harness, tier)
    h.add(PROMPT)
    h.run()
    h.connector.store.flush()
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    spec = h.connector.engine.layout.spec
    for key in keys:
        tier.put(key, _sealed_with_a_mac_and_compressed(spec, tier.get(key)))
    h.connector.store.reset_host()
    h.scheduler.reset_prefix_cache()

    req = h.add(PROMPT)
    assert _step_until_scheduled(h).num_scheduled_tokens == {req.request_id: 300 - 256}
    with h.connector.store.read_host(keys[0]) as held:
        assert held is not None and read_header(held).compression == "zstd"
    assert external_hits(h).hits == 256
    assert h.device_kv_matches(req, 256)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_load_failure(harness, policy):
    h = harness(policy=policy)
    h.add(PROMPT)
    h.run()
    h.scheduler.reset_prefix_cache()
    store = h.connector.store
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    req = h.add(PROMPT)
    # The lookup sees the chunk; it is gone by the time the worker loads it.
    original = store.read_host
    store.read_host = lambda key: _gone() if key == keys[2] else original(key)
    h.step()
    store.read_host = original
    if policy == "recompute":
        assert h.worker.worker.stats.data["load_errors"] == 0  # taken by the step's stats
        running = h.scheduler.requests[req.request_id]
        assert running.num_computed_tokens == 128  # truncated at the failed chunk
        h.step()
        assert h.device_kv_matches(req, 288)
        h.run()
        assert h.finished[req.request_id] == FinishReason.LENGTH
    else:
        assert h.finished.get(req.request_id) == FinishReason.ERROR


def test_preempted_request_reloads(harness):
    h = harness()
    h.add(PROMPT)
    h.run()
    h.scheduler.reset_prefix_cache()
    req = h.add(PROMPT, max_tokens=8)
    h.step()
    h.step()
    assert h.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert req.status == RequestStatus.PREEMPTED
    h.step()
    assert external_hits(h).preempted_hits >= 256 or h.device_kv_matches(req, 256)
    h.run()
    assert h.finished[req.request_id] == FinishReason.LENGTH


def test_aborted_request_leaves_no_state(harness):
    tier = SlowStore()
    h = _tier_harness(harness, tier)
    h.add(PROMPT)
    h.run()
    h.connector.store.flush()
    h.connector.store.reset_host()
    h.scheduler.reset_prefix_cache()
    req = h.add(PROMPT)
    h.step()  # prefetch in flight
    h.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    tier.gate.set()
    h.run()
    assert not h.connector.scheduler._reqs
    assert not h.scheduler.has_unfinished_requests()


def test_hybrid_groups_load_async_and_fail_by_request(harness):
    h = harness(sliding_window=128)
    h.add(PROMPT)
    h.run()
    assert len(h.connector.store.host) == 4
    h.scheduler.reset_prefix_cache()
    req = h.add(PROMPT)
    out = h.step()
    assert not out.has_sync_kv_loads  # async: completion comes through transfer results
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.step()  # the worker reported the receive as finished
    assert external_hits(h).hits == 256
    full_attention = ("model.layers.0.self_attn.attn",)
    assert h.device_kv_matches(req, 256, layers=full_attention)
    h.run()
    assert h.finished[req.request_id] == FinishReason.LENGTH

    # A failed receive is reported per request (block ids are ambiguous across groups);
    # vLLM recomputes the whole prompt.
    h.scheduler.reset_prefix_cache()
    store = h.connector.store
    original = store.read_host
    store.read_host = lambda key: _gone()
    req2 = h.add(PROMPT)
    h.step()
    h.step()
    store.read_host = original
    assert req2.num_computed_tokens == 300  # the failed chunks left host memory: recomputed
    assert h.device_kv_matches(req2, 288, layers=full_attention)
    h.run()
    assert h.finished[req2.request_id] == FinishReason.LENGTH


def test_metrics_port_serves_library_metrics_after_a_workload(harness):
    import urllib.request

    def scrape(url: str, name: str) -> float:
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in body.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        ]
        return sum(values)

    h = harness(extra={"metrics_port": 0})
    server = h.connector.metrics_server
    assert server is not None and server.host == "127.0.0.1"
    saved = 'chunkstore_device_bytes_total{direction="device_to_host"}'
    before = scrape(server.url, saved)
    h.add(PROMPT)
    h.run()
    assert scrape(server.url, saved) > before
    assert scrape(server.url, "chunkstore_host_cache_chunks") >= 4
    h.connector.shutdown()
    assert h.connector.metrics_server is None
