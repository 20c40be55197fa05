"""The worker with copies still in flight (the CUDA copier over a stand-in runtime, on CPU).

Under vLLM's real scheduler: a save is sealed and stored only once its copy
completes; a synchronous load makes the forward pass wait on the device, not
the CPU; an asynchronous (hybrid) load is reported finished only when its
copy is complete, and its host slots stay pinned until then.
"""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from chunkstore.device import CudaCopier  # noqa: E402
from chunkstore.vllm.testing import sample_prompt_ids  # noqa: E402
from tests.device.fake_cuda import FakeRuntime  # noqa: E402

from .harness import make_harness, shut_down  # noqa: E402

PROMPT = sample_prompt_ids(300, seed=21)


@pytest.fixture
def harness(tiny_model):
    made = []

    def make(**kwargs):
        h = make_harness(tiny_model, **kwargs)
        rt = FakeRuntime(pinned=True, auto_complete=False)
        made.append((h, rt))
        h.worker.worker.register_kv_caches(h.kv, copier=CudaCopier("cpu", rt), cpu_isa="vec")
        return h, rt

    yield make
    for h, rt in made:
        rt.complete_all()  # copies a test left in flight finish, so shutdown's drain returns
        shut_down(h)


def test_saves_are_stored_when_their_copy_completes(harness):
    h, rt = harness()
    h.add(PROMPT)
    h.run()
    worker = h.worker.worker
    store = h.connector.store
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    assert len(keys) == 4
    assert not any(store.host.contains(k) for k in keys)  # copies still "on the device"
    rt.complete_all()
    worker.poll()
    assert all(store.host.contains(k) for k in keys)
    assert worker.stats.data["saved_chunks"] == 4

    # A synchronous load: the forward pass waits on the load's event, the CPU does not.
    h.scheduler.reset_prefix_cache()
    req = h.add(PROMPT)
    waited_before = len(rt.compute.waited)
    out = h.step()
    assert out.has_sync_kv_loads
    load_done = rt.events[-1]
    assert rt.compute.waited[waited_before:][-1] is load_done
    assert h.device_kv_matches(req, 256)


def test_async_load_is_reported_when_its_copy_completes(harness):
    h, rt = harness(sliding_window=128)
    rt.auto_complete = True
    h.add(PROMPT)
    h.run()
    assert len(h.connector.store.host) == 4
    rt.auto_complete = False
    h.scheduler.reset_prefix_cache()
    req = h.add(PROMPT)
    h.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pool = h.connector.store.host.cache.pool
    assert pool.pinned_slots() == 4  # the host slots being read stay pinned
    for _ in range(3):
        h.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    rt.complete_all()
    h.step()  # the worker reports the receive finished
    h.step()
    assert req.status == RequestStatus.RUNNING
    assert pool.pinned_slots() == 0
    assert h.device_kv_matches(req, 256, layers=("model.layers.0.self_attn.attn",))
    h.run()


def test_failed_async_load_is_reported_only_after_the_batch_completes(harness):
    h, rt = harness(sliding_window=128)
    rt.auto_complete = True
    h.add(PROMPT)
    h.run()
    rt.auto_complete = False
    h.scheduler.reset_prefix_cache()
    store = h.connector.store
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    original = store.read_host
    store.read_host = lambda key: _gone() if key == keys[2] else original(key)
    failed: list[set[str]] = []
    results = h.worker.get_transfer_results

    def spy(finished):
        out = results(finished)
        failed.append(set(out.failed_recving))
        return out

    h.worker.get_transfer_results = spy
    req = h.add(PROMPT)
    h.step()
    h.step()
    store.read_host = original
    # Chunks 0 and 1 are still being copied into its blocks: no recompute may start yet.
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not any(failed)
    rt.complete_all()
    rt.auto_complete = True  # the retry loads chunks 0 and 1 again
    h.step()
    assert req.request_id in set().union(*failed)
    for _ in range(10):
        h.step()
        if req.num_computed_tokens >= 300:
            break
    assert h.device_kv_matches(req, 288, layers=("model.layers.0.self_attn.attn",))
    h.run()


@contextlib.contextmanager
def _gone():
    yield None


def test_sleep_mode_drains_copies_in_flight_and_leaves_the_device_alone(harness):
    """vLLM 0.33 sleep: unregister_kv_caches finishes our copies before the KV cache is
    unmapped (saves sealed into host memory, pinned load slots released); until
    restore_kv_caches, loads fail (recomputed) and saves are skipped."""
    from chunkstore.vllm.connector import ChunkStoreConnector

    assert ChunkStoreConnector.supports_sleep_mode(None)
    h, rt = harness()
    h.add(PROMPT)
    h.run()
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    store = h.connector.store
    assert not any(store.host.contains(k) for k in keys)  # saves still "on the device"
    worker = h.worker.worker
    # The (fake) device completes the copies while the worker waits on them: that is what a
    # drain does on a real device; here the wait itself completes them.
    rt.auto_complete = True
    h.worker.unregister_kv_caches()
    h.worker.unregister_kv_caches()  # idempotent
    assert worker.suspended and not worker._pending
    assert all(store.host.contains(k) for k in keys)
    assert store.host.cache.pool.pinned_slots() == 0

    # Asleep: a hit is planned by the scheduler but the worker does not touch device memory.
    h.scheduler.reset_prefix_cache()
    copies_before = len(rt.events)
    reported: list[set[int]] = []
    take = worker.take_load_errors
    worker.take_load_errors = lambda: reported.append(take()) or reported[-1]
    req = h.add(PROMPT)
    h.step()
    assert len(rt.events) == copies_before
    assert reported[0]  # the planned blocks are reported unloaded: vLLM recomputes them

    h.worker.restore_kv_caches()
    h.worker.restore_kv_caches()  # idempotent
    assert not worker.suspended
    h.run()
    assert req.request_id in h.finished
