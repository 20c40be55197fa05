"""Connector faults found in review: decode saves under vLLM's asynchronous scheduling,
prompt embeddings, a device copy that fails, a failed chunk's neighbours, a kv_producer.

Each drives vLLM's real scheduler with the connector (tests/vllm/harness.py), no engine.
"""

from __future__ import annotations

import contextlib

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

import tests.vllm.harness as H
from chunkstore.device import CudaCopier
from chunkstore.vllm.testing import sample_prompt_ids
from tests.device.fake_cuda import FakeRuntime

PROMPT = sample_prompt_ids(300, seed=1)
SAMPLED = 5


def _forward(h, out):
    """Stand-in forward pass; tokens not yet appended (placeholders) are SAMPLED."""
    computed = H.scheduled_starts(out)
    reqs = list(computed)
    sampled = []
    for req_id in reqs:
        n, start = out.num_scheduled_tokens[req_id], computed[req_id]
        request = h.scheduler.requests[req_id]
        h._forward(req_id, request, start, n, placeholder=SAMPLED)
        sampled.append([SAMPLED] if start + n >= request.num_prompt_tokens else [])
    return reqs, sampled


def _run_worker(h, out):
    w = h.worker
    w.bind_connector_metadata(out.kv_connector_metadata)
    reqs, sampled = _forward(h, out)
    w.start_load_kv(None)
    w.wait_for_save()
    res = w.get_transfer_results(out.finished_req_ids)
    errors = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    kv_out = KVConnectorOutput(
        finished_recving=res.finished_recving or None,
        failed_recving=res.failed_recving,
        invalid_block_ids=errors,
    )
    return ModelRunnerOutput(
        req_ids=reqs,
        req_id_to_index={r: i for i, r in enumerate(reqs)},
        sampled_token_ids=sampled,
        kv_connector_output=kv_out,
    )


def test_decode_chunks_are_saved_under_asynchronous_scheduling(tiny_model, monkeypatch):
    # vLLM's AsyncScheduler plans a step while the token sampled last step is still a
    # placeholder: a chunk completed by it is saved a step later, over its real tokens,
    # instead of being hashed over 63 tokens (which made the worker raise, taking the
    # engine down).
    monkeypatch.setattr(H, "Scheduler", AsyncScheduler)
    with H.harnesses(tiny_model) as make:
        h = make()
        sched = h.scheduler
        assert isinstance(sched, AsyncScheduler)
        req = h.add(sample_prompt_ids(100, seed=1), max_tokens=40)  # crosses token 128
        planned = []
        build = h.connector.scheduler.build_connector_meta

        def recording(scheduler_output):
            meta = build(scheduler_output)
            planned.extend(len(s.tokens) for s in meta.saves)
            return meta

        h.connector.scheduler.build_connector_meta = recording
        pending = None
        for _ in range(60):
            if not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            runner_out = _run_worker(h, out)  # raised before the fix
            if pending is not None:
                sched.update_from_output(*pending)
            pending = (out, runner_out)
        assert planned and all(n == 64 for n in planned), planned
        engine = h.connector.engine
        keys = engine.keys(list(req.all_token_ids)[:128], engine.root())
        assert len(keys) == 2  # the second chunk ends in generated tokens
        assert all(h.connector.store.host.contains(k) for k in keys)


def _embeds_request(h, rid, seed):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    params.update_from_generation_config({}, H.EOS)
    g = torch.Generator().manual_seed(seed)
    req = Request(
        rid,
        None,
        params,
        None,
        block_hasher=get_request_block_hasher(H.BLOCK, sha256),
        prompt_embeds=torch.randn(200, 16, generator=g),
    )
    h.scheduler.add_request(req)
    return req


def test_prompts_given_as_embeddings_neither_load_nor_save(tiny_model):
    # Embedded positions read as token 0: two prompts of different embeddings would share
    # keys, and the second would load the first one's KV.
    with H.harnesses(tiny_model) as make:
        h = make()
        a = _embeds_request(h, "embeds-a", seed=1)
        h.run()
        engine = h.connector.engine
        keys = engine.keys([0] * 200, engine.root_of(a))
        assert keys and not any(h.connector.store.host.contains(k) for k in keys)
        b = _embeds_request(h, "embeds-b", seed=2)
        assert h.connector.scheduler.get_num_new_matched_tokens(b, 0) == (0, False)


def _saved_then_asked_again(h):
    """PROMPT saved by one request, then asked for by a second (prefix cache reset)."""
    h.add(PROMPT)
    h.run()
    engine = h.connector.engine
    keys = engine.keys(PROMPT, engine.root())
    assert len(keys) == 4 and all(h.connector.store.host.contains(k) for k in keys)
    h.scheduler.reset_prefix_cache()
    h.add(PROMPT)
    return keys


def test_a_device_copy_that_fails_is_a_recompute_not_a_crash(tiny_model):
    with H.harnesses(tiny_model) as make:
        h = make()
        keys = _saved_then_asked_again(h)
        worker = h.worker.worker

        def no_memory(*_args, **_kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        failed = []
        fail = worker._fail

        def counted(load, **kwargs):
            failed.append(load.key)
            fail(load, **kwargs)

        worker.copy_in = no_memory
        worker._fail = counted
        h.step()  # raised before the fix
        assert failed == keys  # every chunk of the batch reported failed
        h.run()  # vLLM recomputes the blocks; the request completes
        host = h.connector.store.host
        # Only the first chunk leaves host memory (the retry sees a shorter hit).
        assert [host.contains(k) for k in keys] == [False, True, True, True]


def test_a_failed_chunk_leaves_the_request_s_later_chunks_in_host_memory(tiny_model):
    with H.harnesses(tiny_model) as make:
        h = make()
        keys = _saved_then_asked_again(h)
        store = h.connector.store
        read_host = store.read_host

        @contextlib.contextmanager
        def first_corrupt(key):
            if key == keys[0]:
                yield b"\0" * 16
                return
            with read_host(key) as data:
                yield data

        h.worker.worker.store.read_host = first_corrupt
        h.step()
        assert [store.host.contains(k) for k in keys] == [False, True, True, True]


def test_a_kv_producer_saves_what_it_computes(tiny_model):
    # With loads off (kv_producer's default) the scheduler still tracks requests to save.
    with H.harnesses(tiny_model) as make:
        h = make(extra={"load": False})
        h.add(PROMPT)
        h.run()
        engine = h.connector.engine
        keys = engine.keys(PROMPT, engine.root())
        assert keys and all(h.connector.store.host.contains(k) for k in keys)


def test_the_cuda_copier_settles_by_waiting_for_its_side_stream():
    # After a batch failed part-way, the worker waits for what was issued before it hands
    # the batch's host slots back or reports its loads failed.
    copier = CudaCopier("cpu", runtime=FakeRuntime())
    copier.settle()
    assert copier.stream.synchronized == 1
