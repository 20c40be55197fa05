"""ChunkStoreTier under faults inside its own jobs: every job is reported, permits come back,
and a store call that timed out but still runs can never put bytes into a primary slot."""

from __future__ import annotations

import errno
import threading
from concurrent.futures import Future

import pytest
import torch

import chunkstore.vllm.native.tier as tier_module
from chunkstore._hugepages import PAGE
from chunkstore.tiering import ChunkBuffers
from chunkstore.vllm.native.reading import LoadJobChunk
from chunkstore.vllm.native.tier import CALLS_IN_FLIGHT
from chunkstore.vllm.testing import sample_prompt_ids

from .tier_harness import (
    CHUNK_TOKENS,
    announce,
    finish,
    job,
    make_request,
    make_tier,
    nhd_slot,
    offload_keys,
    primary,
)

PROMPT = sample_prompt_ids(300, seed=41)  # 4 full chunks of 64 tokens


@pytest.fixture
def tier_env(harness, tmp_path):
    made = []

    def make(paths=None, slots=16, **options):
        mem = primary(slots)
        tier = make_tier(harness(), mem, [str(p) for p in paths or [tmp_path / "kv"]], **options)
        made.append(tier)
        return tier, mem

    yield make
    for tier in made:
        tier.shutdown()


def _prompt_in_slots(tier, mem, req_id, chunks):
    request = make_request(PROMPT, req_id)
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, chunks)
    for i in range(chunks):
        mem[i] = nhd_slot(list(request.all_token_ids), i * CHUNK_TOKENS)
    return ctx, keys


def test_a_store_job_without_buffers_is_reported_failed_and_gives_its_permits_back(
    tier_env, monkeypatch
):
    tier, mem = tier_env()
    ctx, keys = _prompt_in_slots(tier, mem, "no-memory", 2)
    free = tier._writing._value
    take = tier._buffers.take

    def no_memory(_count):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(tier._buffers, "take", no_memory)
    tier.submit_store(job(keys, [0, 1], ctx, promotion=False))
    (result,) = finish(tier)
    assert not result.success
    assert not tier.has_pending_work()
    assert tier._writing._value == free  # every permit back: later jobs are not starved
    monkeypatch.setattr(tier._buffers, "take", take)
    tier.submit_store(job(keys, [0, 1], ctx, promotion=False))
    (again,) = finish(tier)
    assert again.success
    assert len(list(tier.stores[0].list())) == 2


def test_a_job_that_raises_unexpectedly_is_still_reported(tier_env, monkeypatch):
    tier, mem = tier_env()
    ctx, keys = _prompt_in_slots(tier, mem, "raises", 2)

    def broken(*_args):
        raise RuntimeError("a defect inside the job")

    monkeypatch.setattr(tier, "_settle", broken)
    tier.submit_store(job(keys, [0, 1], ctx, promotion=False))
    monkeypatch.setattr(tier, "_finish_load", broken)
    tier.submit_load(job(keys, [5, 6], ctx, promotion=True))
    results = finish(tier)
    assert len(results) == 2 and not any(r.success for r in results)
    assert not tier.has_pending_work()


def test_a_late_write_of_a_timed_out_store_never_reaches_the_primary_slot(
    tier_env, tmp_path, monkeypatch
):
    # Store A hangs past the timeout and, while B's verified copy is being scattered, writes
    # other bytes into the buffer it was given: they must not be what lands in the slot.
    # The timeout also bounds B's healthy read, so it is long enough for a loaded CI host.
    tier, mem = tier_env([tmp_path / "a", tmp_path / "b"], tier_timeout=3.0, retry_after=60)
    ctx, keys = _prompt_in_slots(tier, mem, "late", 1)
    tier.submit_store(job(keys, [0], ctx, promotion=False))
    (stored,) = finish(tier)
    assert stored.success  # in both stores
    scatter_began, late_write_done = threading.Event(), threading.Event()

    def late_reader(wanted, buffers):
        assert scatter_began.wait(30)
        for view in buffers:
            view[:] = b"\xee" * len(view)
        late_write_done.set()
        return [None] * len(wanted)

    from_payload = tier.primary.from_payload

    def scatter(payload, slot):
        scatter_began.set()
        assert late_write_done.wait(30)
        return from_payload(payload, slot)

    monkeypatch.setattr(tier.stores[0], "get_many_into", late_reader)
    monkeypatch.setattr(tier.primary, "from_payload", scatter)
    tier.submit_load(job(keys, [5], ctx, promotion=True))
    (loaded,) = finish(tier)
    assert loaded.success  # from B
    assert torch.equal(mem[5], mem[0])


@pytest.mark.parametrize("cores", [2, 128])
def test_work_queued_on_the_stores_does_not_grow_with_the_cores(tier_env, monkeypatch, cores):
    # A call's timeout counts from when it is queued: a queue that grew with the host's cores
    # would time out a slow but healthy store on a large host.
    monkeypatch.setattr(tier_module, "_cores", lambda: cores)
    tier, _ = tier_env()
    assert tier.max_writing == tier.max_reading == 2 * CALLS_IN_FLIGHT


def test_a_read_never_taken_is_cancelled_if_it_has_not_started():
    pool = ChunkBuffers(PAGE, keep=4)
    given = threading.Semaphore(0)
    load = LoadJobChunk(key=None, pool=pool, give_permit=given.release)  # type: ignore[arg-type]
    queued: Future[None] = Future()

    class _Call:
        future = queued

    class _Read:
        call = _Call()

    load.read = _Read()  # type: ignore[assignment]
    held = load.buffers[0]
    load.close()
    assert queued.cancelled()
    assert given.acquire(blocking=False)
    assert any(b is held for b in pool.take(4))  # back at once: nothing will write into it
    pool.close()


def test_buffers_given_back_after_close_are_unmapped():
    pool = ChunkBuffers(PAGE, keep=4)
    (late,) = pool.take(1)
    mapping = late.obj
    pool.close()
    pool.give([late])  # a call abandoned at shutdown ends afterwards
    assert mapping.closed


def test_a_start_up_without_memory_for_buffers_leaves_no_threads_or_stores(
    harness, tmp_path, monkeypatch
):
    # Reserving the tier's buffers is the last thing start-up does; where it fails (no
    # memory) the stores already opened and the threads already started used to stay behind.
    from chunkstore.backends._fs import FsStore
    from chunkstore.tiering import ChunkBuffers

    def no_memory(self, count):
        raise MemoryError("no memory for the tier's buffers")

    closed = []
    close = FsStore.close
    monkeypatch.setattr(ChunkBuffers, "reserve", no_memory)
    monkeypatch.setattr(FsStore, "close", lambda self: (closed.append(self), close(self))[1])
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(MemoryError):
        make_tier(harness(), primary(4), [str(tmp_path / "kv")])
    started = [
        t for t in threading.enumerate() if t.name not in before and t.name.startswith("chunkstore")
    ]
    for thread in started:  # idle workers told to stop end at once (none is left waiting)
        thread.join(timeout=10)
    assert [t.name for t in started if t.is_alive()] == []
    assert len(closed) == 1
