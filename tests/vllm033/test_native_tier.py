"""ChunkStoreTier driven as vLLM 0.33 drives a secondary tier (memoryview primary, CPU only).

Store -> lookup -> load round trips; chunks written by ChunkStoreConnector load through the
tier and the reverse; a new process finds what an earlier one stored; a corrupt chunk is a
failed load that leaves the primary slot untouched; a store that is down or hangs never
blocks the caller; many jobs in flight; shutdown drains.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_offload.base import Locality, LookupResult
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from chunkstore.backends import _fastread as fastread
from chunkstore.backends import open_store
from chunkstore.errors import ConfigError
from chunkstore.format import decode_chunk
from chunkstore.metrics import default_metrics
from chunkstore.tiering import _buffers as buffers_module
from chunkstore.vllm.native import tier as tier_module
from chunkstore.vllm.testing import sample_prompt_ids
from tests.backends.test_fastread import refuse_o_direct
from tests.vllm.harness import BLOCK

from .tier_harness import (
    CHUNK_TOKENS,
    SLOT_BYTES,
    announce,
    finish,
    job,
    lookup,
    make_request,
    make_tier,
    nhd_slot,
    offload_keys,
    primary,
)

PROMPT = sample_prompt_ids(300, seed=31)  # 4 full chunks of 64 tokens
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tier_env(harness, tmp_path):
    made = []

    def make(path=None, slots=16, **options):
        h = harness()
        mem = primary(slots)
        tier = make_tier(h, mem, [str(path or tmp_path / "kv")], **options)
        made.append(tier)
        return tier, mem, h

    yield make
    for tier in made:
        tier.shutdown()


def _store_prompt(tier, mem, request, slots):
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, len(slots))
    for i, slot in enumerate(slots):
        mem[slot] = nhd_slot(list(request.all_token_ids), i * CHUNK_TOKENS)
    tier.submit_store(job(keys, slots, ctx, promotion=False))
    results = finish(tier)
    return ctx, keys, results


def _twelve_chunks_in_slots(tier, mem, req_id, *, seed):
    """A request of 12 chunks announced to ``tier``, chunk i's KV in primary slot i."""
    prompt = sample_prompt_ids(12 * CHUNK_TOKENS + 5, seed=seed)
    request = make_request(prompt, req_id)
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, 12)
    for i in range(12):
        mem[i] = nhd_slot(prompt, i * CHUNK_TOKENS)
    return ctx, keys


def _record_reads(store, monkeypatch):
    """The keys ``store`` is asked to read from now on, in the order asked."""
    asked = []
    get_many_into = store.get_many_into

    def recording(wanted, buffers):
        asked.extend(wanted)
        return get_many_into(wanted, buffers)

    monkeypatch.setattr(store, "get_many_into", recording)
    return asked


def test_store_lookup_load_round_trip_is_byte_identical(tier_env, tmp_path):
    tier, mem, _ = tier_env(locality="LOCAL")
    assert tier.locality is Locality.LOCAL and tier.cache_hit_source is CacheHitSource.DISK
    request = make_request(PROMPT, "rt")
    ctx, keys, results = _store_prompt(tier, mem, request, [0, 1, 2, 3])
    assert [r.success for r in results] == [True]
    assert results[0].transfer_bytes > 0
    assert lookup(tier, keys, ctx) == [LookupResult.HIT] * 4

    tier.submit_load(job(keys, [8, 9, 10, 11], ctx, promotion=True))
    (loaded,) = finish(tier)
    assert loaded.success
    assert torch.equal(mem[8:12], mem[0:4])

    # The files are chunk format v1 under the connector's keys, with their tokens.
    store = open_store(str(tmp_path / "kv"))
    infos = list(store.list())
    assert len(infos) == 4
    by_key = {info.key: decode_chunk(store.get(info.key)) for info in infos}
    spans = sorted(tuple(c.header.tokens) for c in by_key.values())
    assert spans == sorted(tuple(PROMPT[i * 64 : (i + 1) * 64]) for i in range(4))
    kv = str(tmp_path / "kv")
    some_key = infos[0].key.hex
    for args in (
        ["verify", kv],
        ["ls", "--json", kv],
        ["show", "--json", kv, some_key],
        ["prune", "--max-bytes", "1", kv],
    ):
        cli = subprocess.run(
            [sys.executable, "-m", "chunkstore.cli.main", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert cli.returncode == 0, (args, cli.stdout + cli.stderr)
        if args[0] == "ls":
            assert len(json.loads(cli.stdout)["chunks"]) == 4
        if args[0] == "show":
            assert str(PROMPT[0]) in cli.stdout or some_key in cli.stdout
    assert not list(store.list())  # pruned to under 1 byte

    registry = default_metrics().registry
    name = tier.stores[0].name
    written = registry.get_sample_value(
        "chunkstore_transfer_bytes_total", {"tier": name, "direction": "write"}
    )
    assert written and written >= 4 * SLOT_BYTES


def test_chunks_saved_by_the_connector_load_through_the_tier(tier_env, harness, tmp_path):
    kv_dir = tmp_path / "kv"
    h = harness(extra={"tiers": [str(kv_dir)]})
    first = h.add(PROMPT)
    h.run()
    h.connector.store.flush()

    tier, mem, _ = tier_env(kv_dir)
    ctx = announce(tier, first)
    keys = offload_keys(first, ctx, 4)
    assert lookup(tier, keys, ctx) == [LookupResult.HIT] * 4
    tier.submit_load(job(keys, [3, 4, 5, 6], ctx, promotion=True))
    (result,) = finish(tier)
    assert result.success
    for i in range(4):
        assert torch.equal(mem[3 + i], nhd_slot(PROMPT, i * CHUNK_TOKENS)), f"chunk {i}"


def test_chunks_stored_by_the_tier_hit_in_the_connector(tier_env, harness, tmp_path):
    kv_dir = tmp_path / "kv"
    tier, mem, _ = tier_env(kv_dir)
    _, _, results = _store_prompt(tier, mem, make_request(PROMPT, "tier-writer"), [0, 1, 2, 3])
    assert results[0].success

    h = harness(extra={"tiers": [str(kv_dir)]})
    req = h.add(PROMPT)
    for _ in range(500):
        out = h.step()
        if out.num_scheduled_tokens:
            break
    hits, by_source, _ = h.external_hits()
    assert hits == 256
    assert h.device_kv_matches(req, 256)  # loaded bytes, not recomputed ones
    h.run()


def test_a_new_process_finds_what_an_earlier_one_stored(tier_env, tiny_model, tmp_path):
    tier, mem, _ = tier_env()
    _store_prompt(tier, mem, make_request(PROMPT, "earlier"), [0, 1, 2, 3])
    tier.shutdown()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.vllm033.new_process",
            str(tiny_model),
            str(tmp_path / "kv"),
            json.dumps(PROMPT),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["lookups"] == ["HIT"] * 4
    assert report["loaded"] is True
    assert report["slots_match"] is True


def test_a_corrupt_chunk_is_a_failed_load_and_its_slot_is_untouched(tier_env, tmp_path):
    tier, mem, _ = tier_env()
    request = make_request(PROMPT, "corrupt")
    ctx, keys, _ = _store_prompt(tier, mem, request, [0, 1])
    store = open_store(str(tmp_path / "kv"))
    second = [
        i.key for i in store.list() if decode_chunk(store.get(i.key)).header.tokens[0] == PROMPT[64]
    ]
    path = tmp_path / "kv" / second[0].path
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(data))

    sentinel = torch.full((SLOT_BYTES,), 0xA5, dtype=torch.uint8)
    mem[6] = sentinel
    mem[7] = sentinel
    assert lookup(tier, keys, ctx) == [LookupResult.HIT] * 2  # present until read
    tier.submit_load(job(keys, [6, 7], ctx, promotion=True))
    (result,) = finish(tier)
    assert not result.success
    assert list(result.successful_keys) == [keys[0]]
    assert torch.equal(mem[6], mem[0])  # the good chunk loaded
    assert torch.equal(mem[7], sentinel)  # the bad one never reached the slot
    assert tier.lookup(keys[1], ctx) == LookupResult.MISS  # recomputed, not retried
    assert not path.exists()  # quarantined by the store


def test_a_load_ends_at_the_first_missing_chunk_writing_nothing_past_it(tier_env, monkeypatch):
    tier, mem, _ = tier_env()
    request = make_request(PROMPT, "prefix")
    ctx, keys, _ = _store_prompt(tier, mem, request, [0, 1, 2, 3])
    store = tier.stores[0]
    store.delete_many([tier._address(keys[1], ctx).key])
    asked = _record_reads(store, monkeypatch)
    sentinel = torch.full((SLOT_BYTES,), 0xA5, dtype=torch.uint8)
    mem[8:12] = sentinel
    tier.submit_load(job(keys, [8, 9, 10, 11], ctx, promotion=True))
    (result,) = finish(tier)
    assert not result.success and list(result.successful_keys) == [keys[0]]
    assert torch.equal(mem[8], mem[0])
    assert all(torch.equal(mem[i], sentinel) for i in (9, 10, 11))
    # read in order, ahead of the scatter: chunks 2 and 3 may have been read, never written
    chunk_keys = [tier._address(k, ctx).key for k in keys]
    assert set(chunk_keys[:2]) <= set(asked) <= set(chunk_keys)
    assert len(asked) == len(set(asked))  # each read once


def test_a_load_job_reads_its_next_chunk_while_one_is_scattered(tier_env, monkeypatch):
    # One thread: the first chunk's scatter into its slot waits until the second chunk's
    # read has begun on the store, which a job reading chunk by chunk never does.
    tier, mem, _ = tier_env(threads=1)
    request = make_request(PROMPT, "load-overlap")
    ctx, keys, _ = _store_prompt(tier, mem, request, [0, 1, 2, 3])
    store = tier.stores[0]
    second = tier._address(keys[1], ctx).key
    second_read = threading.Event()
    get_many_into = store.get_many_into

    def recording(wanted, buffers):
        if second in wanted:
            second_read.set()
        return get_many_into(wanted, buffers)

    from_payload = tier.primary.from_payload
    waited = []

    def first_waits(payload, slot):
        if not waited:
            waited.append(second_read.wait(30))
        return from_payload(payload, slot)

    monkeypatch.setattr(store, "get_many_into", recording)
    monkeypatch.setattr(tier.primary, "from_payload", first_waits)
    tier.submit_load(job(keys, [8, 9, 10, 11], ctx, promotion=True))
    (result,) = finish(tier)
    assert waited == [True] and result.success
    assert all(torch.equal(mem[8 + i], mem[i]) for i in range(4))


def _one_flipped_chunk_unverified(tier_env, tmp_path, req_id):
    """A tier over a store opened with verify=False, holding one chunk with one payload
    bit flipped on disk: (tier, primary, request context, keys, the chunk's file)."""
    kv = tmp_path / "kv"
    tier, mem, _ = tier_env(store_options={str(kv): {"verify": False}})
    ctx, keys, _ = _store_prompt(tier, mem, make_request(PROMPT, req_id), [0])
    (info,) = list(open_store(str(kv)).list())
    path = kv / info.key.path
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(data))
    return tier, mem, ctx, keys, path


def test_verify_turned_on_during_a_read_does_not_vouch_for_it(tier_env, tmp_path, monkeypatch):
    # Whether the store checked what it returned is its verify as the read began: turned on
    # while an unchecked read was returning, it used to skip the tier's own checksum, and a
    # flipped payload bit reached vLLM's slot.
    tier, mem, ctx, keys, _ = _one_flipped_chunk_unverified(tier_env, tmp_path, "flip")
    (store,) = tier.stores
    real = store.get_many_into

    def turned_on_while_returning(asked, buffers):
        sizes = real(asked, buffers)
        store.verify = True
        return sizes

    monkeypatch.setattr(store, "get_many_into", turned_on_while_returning)
    sentinel = torch.full((SLOT_BYTES,), 0xA5, dtype=torch.uint8)
    mem[6] = sentinel
    tier.submit_load(job(keys, [6], ctx, promotion=True))
    (result,) = finish(tier)
    assert not result.success
    assert torch.equal(mem[6], sentinel)  # the damaged chunk never reached the slot
    assert tier.corrupt == 1


def test_a_corrupt_chunk_mid_job_fails_only_that_load(tier_env, tmp_path, monkeypatch):
    # Two pipelined load jobs in flight: the one whose third chunk is corrupt keeps its first
    # two chunks and leaves the rest of its slots untouched (the fourth chunk, read ahead, is
    # never written); the other loads whole.
    tier, mem, _ = tier_env(threads=2)
    bad = make_request(sample_prompt_ids(4 * CHUNK_TOKENS + 5, seed=41), "mid-bad")
    good = make_request(sample_prompt_ids(4 * CHUNK_TOKENS + 5, seed=42), "mid-good")
    bad_ctx, bad_keys, _ = _store_prompt(tier, mem, bad, [0, 1, 2, 3])
    good_ctx, good_keys, _ = _store_prompt(tier, mem, good, [4, 5, 6, 7])
    chunk_keys = [tier._address(k, bad_ctx).key for k in bad_keys]
    path = tmp_path / "kv" / chunk_keys[2].path
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit of the payload
    path.write_bytes(bytes(data))
    store = tier.stores[0]
    asked = _record_reads(store, monkeypatch)
    sentinel = torch.full((SLOT_BYTES,), 0xA5, dtype=torch.uint8)
    mem[8:16] = sentinel
    bad_job = job(bad_keys, [8, 9, 10, 11], bad_ctx, promotion=True)
    good_job = job(good_keys, [12, 13, 14, 15], good_ctx, promotion=True)
    tier.submit_load(bad_job)
    tier.submit_load(good_job)
    results = {r.job_id: r for r in finish(tier)}
    assert not results[bad_job.job_id].success
    assert list(results[bad_job.job_id].successful_keys) == bad_keys[:2]
    assert torch.equal(mem[8], mem[0]) and torch.equal(mem[9], mem[1])
    assert torch.equal(mem[10], sentinel) and torch.equal(mem[11], sentinel)
    assert results[good_job.job_id].success
    assert all(torch.equal(mem[12 + i], mem[4 + i]) for i in range(4))
    assert asked.count(chunk_keys[2]) == 1  # the corrupt chunk is not read again
    assert not path.exists()  # quarantined by the store


def test_a_store_job_converts_its_next_chunk_while_one_is_written(tier_env, monkeypatch):
    # One thread: the job's second chunk is converted while its first write has not ended
    # (the write waits for that conversion, which a job writing chunk by chunk never does).
    tier, mem, _ = tier_env(threads=1)
    store = tier.stores[0]
    second_converted = threading.Event()
    converted = []
    to_payload = tier.primary.to_payload

    def converting(slot, payload):
        converted.append(1)
        if len(converted) == 2:
            second_converted.set()
        return to_payload(slot, payload)

    put = store.put_if_absent_many
    waited = []

    def first_waits(items):
        if not waited:
            waited.append(second_converted.wait(30))
        return put(items)

    monkeypatch.setattr(tier.primary, "to_payload", converting)
    monkeypatch.setattr(store, "put_if_absent_many", first_waits)
    _, keys, (result,) = _store_prompt(tier, mem, make_request(PROMPT, "overlap"), [0, 1, 2, 3])
    assert waited == [True] and result.success
    assert len(list(store.list())) == 4


class _Gauge:
    """A count now and the most it reached, from several threads."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self._lock = threading.Lock()

    def add(self, delta: int) -> None:
        with self._lock:
            self.now += delta
            self.most = max(self.most, self.now)


def _count_buffers(tier, monkeypatch):
    """The tier's buffers taken and not given back (a gauge)."""
    held = _Gauge()
    take, give = tier._buffers.take, tier._buffers.give

    def taking(count):
        held.add(count)
        return take(count)

    def giving(buffers):
        buffers = list(buffers)
        held.add(-len(buffers))
        give(buffers)

    monkeypatch.setattr(tier._buffers, "take", taking)
    monkeypatch.setattr(tier._buffers, "give", giving)
    return held


def test_chunks_in_flight_stay_within_the_tiers_bound(tier_env, monkeypatch):
    # Every write waits for a gate: jobs convert chunks ahead only up to max_writing, so the
    # buffers they hold are bounded however many chunks are submitted (a bound of 8 here,
    # below the twelve chunks submitted).
    monkeypatch.setattr(tier_module, "CALLS_IN_FLIGHT", 4)
    tier, mem, _ = tier_env(slots=32, threads=2)
    assert tier.max_writing == 8
    store = tier.stores[0]
    gate = threading.Event()
    held = _count_buffers(tier, monkeypatch)
    writes = _Gauge()  # puts running
    put = store.put_if_absent_many

    def gated(items):
        writes.add(1)
        try:
            assert gate.wait(30)
            return put(items)
        finally:
            writes.add(-1)

    monkeypatch.setattr(store, "put_if_absent_many", gated)
    ctx, keys = _twelve_chunks_in_slots(tier, mem, "bounded", seed=33)
    for first in range(0, 12, 4):
        tier.submit_store(
            job(keys[first : first + 4], list(range(first, first + 4)), ctx, promotion=False)
        )
    deadline = time.monotonic() + 30
    while held.now < tier.max_writing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.now == tier.max_writing  # converted ahead as far as the bound, no further
    gate.set()
    results = finish(tier)
    assert len(results) == 3 and all(r.success for r in results)
    assert held.most == tier.max_writing and writes.most <= 4
    assert held.now == 0
    assert len(list(store.list())) == 12


def test_reads_in_flight_stay_within_the_tiers_bound(tier_env, monkeypatch):
    # Every read waits for a gate: load jobs read ahead only up to max_reading chunks, so the
    # buffers they hold are bounded however many chunks are asked for (8 of twelve here).
    monkeypatch.setattr(tier_module, "CALLS_IN_FLIGHT", 4)
    tier, mem, _ = tier_env(slots=32, threads=2)
    assert tier.max_reading == 8
    ctx, keys = _twelve_chunks_in_slots(tier, mem, "read-bound", seed=34)
    tier.submit_store(job(keys, list(range(12)), ctx, promotion=False))
    assert finish(tier)[0].success
    store = tier.stores[0]
    gate = threading.Event()
    held = _count_buffers(tier, monkeypatch)
    get_many_into = store.get_many_into

    def gated(wanted, buffers):
        assert gate.wait(30)
        return get_many_into(wanted, buffers)

    monkeypatch.setattr(store, "get_many_into", gated)
    for first in range(0, 12, 4):
        tier.submit_load(
            job(keys[first : first + 4], list(range(12 + first, 16 + first)), ctx, promotion=True)
        )
    deadline = time.monotonic() + 30
    while held.now < tier.max_reading and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.now == tier.max_reading  # read ahead as far as the bound, no further
    gate.set()
    results = finish(tier)
    assert len(results) == 3 and all(r.success for r in results)
    assert held.most == tier.max_reading and held.now == 0
    assert torch.equal(mem[12:24], mem[0:12])


def test_a_failed_write_leaves_nothing_half_written(tier_env, monkeypatch, tmp_path):
    import errno

    import chunkstore.backends._fsio as fsio

    tier, mem, _ = tier_env()
    request = make_request(PROMPT, "full")
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, 4)
    failing = tier._address(keys[1], ctx).key
    write_all = fsio.write_all

    def half_then_full_disk(fd, view, direct=False):
        if failing.hex.encode() in bytes(view[:4096]):  # that chunk's header names its key
            write_all(fd, view[: len(view) // 2], False)  # half its bytes reach the file
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_all(fd, view, direct)

    monkeypatch.setattr(fsio, "write_all", half_then_full_disk)
    for i in range(4):
        mem[i] = nhd_slot(PROMPT, i * CHUNK_TOKENS)
    tier.submit_store(job(keys, [0, 1, 2, 3], ctx, promotion=False))
    (result,) = finish(tier)
    assert not result.success
    kv = tmp_path / "kv"
    # Only whole chunks under final names: no temp file, no partial chunk.
    files = [p for p in kv.rglob("*") if p.is_file() and p.suffix not in (".json", "")]
    assert files and all(p.suffix == ".kvc" for p in files), files
    store = open_store(str(kv))
    stored = {info.key for info in store.list()}
    assert failing not in stored and tier._address(keys[0], ctx).key in stored
    assert all(decode_chunk(store.get(key)) for key in stored)  # each one verifies


def test_a_newer_writers_chunk_is_a_plain_miss_left_in_place(tier_env, tmp_path):
    # A store that does not verify hands the tier the raw bytes: the tier's own check must
    # treat a newer minor's chunk (an unknown dtype) as unsupported, not damage.
    from tests.format.strategies import reseal, split_chunk

    kv = tmp_path / "kv"
    tier, mem, _ = tier_env(store_options={str(kv): {"verify": False}})
    request = make_request(PROMPT, "newer")
    ctx, keys, _ = _store_prompt(tier, mem, request, [0])
    store = open_store(str(kv))
    (info,) = list(store.list())
    path = kv / info.key.path
    text, stored = split_chunk(path.read_bytes())
    text = text.replace(b'"chunkstore":"1.0"', b'"chunkstore":"1.1"')
    text = re.sub(rb'"dtype":"[A-Z0-9_]+"', b'"dtype":"F8_E8M0"', text)
    path.write_bytes(reseal(text, stored))

    tier.submit_load(job(keys, [6], ctx, promotion=True))
    (result,) = finish(tier)
    assert not result.success
    assert tier.corrupt == 0
    assert path.exists()  # left for the newer readers that share the store


def test_a_store_that_is_down_or_hangs_never_blocks_the_caller(tier_env, monkeypatch):
    tier, mem, _ = tier_env(tier_timeout=0.2, retry_after=60)
    store = tier.stores[0]
    gate = threading.Event()

    def hang(*_args):
        gate.wait(30)
        raise OSError("mount went away")

    monkeypatch.setattr(store, "exists_many", hang)
    monkeypatch.setattr(store, "put_if_absent_many", hang)
    monkeypatch.setattr(store, "_read_many", hang)
    request = make_request(PROMPT, "down")
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, 2)
    # Each call returns at once; the answers come from the tier's threads.
    assert tier.lookup(keys[0], ctx) == LookupResult.RETRY
    tier.submit_store(job(keys, [0, 1], ctx, promotion=False))
    assert lookup(tier, keys, ctx) == [LookupResult.MISS] * 2  # timed out: down, a miss
    (stored,) = finish(tier)
    assert not stored.success
    tier.submit_load(job(keys, [2, 3], ctx, promotion=True))
    (loaded,) = finish(tier)
    assert not loaded.success and loaded.successful_keys is None
    gate.set()


def test_a_chunk_looked_up_as_missing_is_found_once_this_request_stored_it(tier_env):
    tier, mem, _ = tier_env()
    request = make_request(PROMPT, "miss-then-store")
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, 1)
    assert lookup(tier, keys, ctx) == [LookupResult.MISS]
    mem[0] = nhd_slot(PROMPT, 0)
    tier.submit_store(job(keys, [0], ctx, promotion=False))
    assert finish(tier)[0].success
    assert tier.lookup(keys[0], ctx) == LookupResult.HIT


def test_many_jobs_in_flight(tier_env):
    tier, mem, _ = tier_env(slots=32, threads=4)
    prompt = sample_prompt_ids(12 * CHUNK_TOKENS + 5, seed=32)
    request = make_request(prompt, "many")
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, 12)
    for i in range(12):
        mem[i] = nhd_slot(prompt, i * CHUNK_TOKENS)
    for i in range(12):
        tier.submit_store(job([keys[i]], [i], ctx, promotion=False))
    stores = finish(tier)
    assert len(stores) == 12 and all(r.success for r in stores)
    for i in range(12):
        tier.submit_load(job([keys[i]], [16 + i], ctx, promotion=True))
    loads = finish(tier)
    assert len(loads) == 12 and all(r.success for r in loads)
    assert torch.equal(mem[16:28], mem[0:12])


@pytest.mark.parametrize("per_job", [1, 4])
def test_shutdown_drains_jobs_in_flight(tier_env, monkeypatch, tmp_path, per_job):
    tier, mem, _ = tier_env(slots=16, threads=2)
    store = tier.stores[0]
    release = threading.Event()
    put = store.put_if_absent_many

    def slow_put(items):
        release.wait(30)
        return put(items)

    monkeypatch.setattr(store, "put_if_absent_many", slow_put)
    ctx, keys = _twelve_chunks_in_slots(tier, mem, "drain", seed=34)
    for first in range(0, 12, per_job):
        chunks = list(range(first, first + per_job))
        tier.submit_store(job(keys[first : first + per_job], chunks, ctx, promotion=False))
    assert tier.has_pending_work()
    threading.Timer(0.1, release.set).start()
    tier.shutdown()
    results = list(tier.get_finished_jobs())
    assert len(results) == 12 // per_job and all(r.success for r in results)
    assert len(list(open_store(str(tmp_path / "kv")).list())) == 12


def _tier_with_page_layout(h, mem, path, layout):
    """A ChunkStoreTier over ``mem`` built by vLLM's factory for primary pages in ``layout``."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from . import tier_harness

    vllm_config = h.scheduler.vllm_config  # noqa: F841 - read by the tier from this frame
    kv_cache_config = h.scheduler.kv_cache_config  # noqa: F841
    return SecondaryTierFactory.create_secondary_tier(
        {"type": "ChunkStoreTier", "module_path": "chunkstore.vllm.native", "tiers": [str(path)]},
        memoryview(mem.numpy()),
        tier_harness.offloading_spec(layout=layout),
    )


def test_hnd_pages_give_the_same_chunk_files(harness, tmp_path):
    """Layout independence: the same KV in LBHNC slots writes byte-identical chunks."""
    h = harness()
    files = []
    for layout in ("LBNHC", "LBHNC"):
        mem = primary(4)
        tier = _tier_with_page_layout(h, mem, tmp_path / layout, layout)
        try:
            slot = nhd_slot(PROMPT, 0)
            if layout == "LBHNC":
                # per layer: [N-block pages of T, H, 2D] -> [H, T, 2D] per block
                per_layer = slot.view(2, 2, BLOCK, 2, -1)  # layers, blocks, tokens, heads, 2D
                slot = per_layer.permute(0, 1, 3, 2, 4).contiguous().view(-1)
            mem[0] = slot
            request = make_request(PROMPT, f"layout-{layout}")
            ctx = announce(tier, request)
            keys = offload_keys(request, ctx, 1)
            tier.submit_store(job(keys, [0], ctx, promotion=False))
            assert finish(tier)[0].success
        finally:
            tier.shutdown()
        (path,) = (tmp_path / layout).rglob("*.kvc")
        files.append(path.read_bytes())
    assert files[0] == files[1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tier": "x"}, "unknown option"),
        ({"tiers": 5}, "tiers"),
        ({"threads": 0}, "threads"),
        ({"threads": "many"}, "threads"),
        ({"threads": 10**400}, "threads"),
        ({"tier_timeout": 10**400}, "tier_timeout"),
        ({"tiers": ["nosuchscheme://x"]}, "tiers"),
        ({"tier_timeout": 0}, "tier_timeout"),
        ({"retry_after": "soon"}, "retry_after"),
        ({"locality": "local"}, "locality"),
        ({"compression": "lz4"}, "compression"),
    ],
)
def test_bad_options_name_themselves(harness, tmp_path, options, message):
    h = harness()
    entry = {"tiers": [str(tmp_path)], **options} if "tiers" not in options else dict(options)
    with pytest.raises(ConfigError, match=message):
        _make_with(h, entry)


def _make_with(h, entry):
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from .tier_harness import offloading_spec

    vllm_config = h.scheduler.vllm_config  # noqa: F841 - read by the tier from this frame
    kv_cache_config = h.scheduler.kv_cache_config  # noqa: F841
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "ChunkStoreTier", "module_path": "chunkstore.vllm.native", **entry},
        memoryview(primary(2).numpy()),
        offloading_spec(),
    )
    tier.shutdown()


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_whole_slot_conversion_matches_layer_by_layer(harness, layout, tmp_path):
    """The one-copy conversion of a slot (one rank, layers in order) gives the bytes the
    per-layer layout classes give, both ways."""
    mem = primary(4)
    tier = _tier_with_page_layout(harness(), mem, tmp_path, layout)
    try:
        fused = tier.primary
        assert fused._whole is not None
        gen = torch.Generator().manual_seed(3)
        mem[0] = torch.randint(0, 256, (SLOT_BYTES,), dtype=torch.uint8, generator=gen)
        size = fused.layout.payload_size
        by_copy, by_layer = bytearray(size), bytearray(size)
        fused.to_payload(mem[0].numpy(), by_copy)
        whole, fused._whole = fused._whole, None
        try:
            fused.to_payload(mem[0].numpy(), by_layer)
            assert by_copy == by_layer
            fused.from_payload(by_layer, mem[1].numpy())
        finally:
            fused._whole = whole
        fused.from_payload(by_copy, mem[2].numpy())
        kv = fused.kv_bytes
        assert torch.equal(mem[1][:kv], mem[0][:kv]) and torch.equal(mem[2][:kv], mem[0][:kv])
    finally:
        tier.shutdown()


def test_a_directory_tier_writes_around_the_page_cache_unless_told_otherwise(tier_env, tmp_path):
    tier, _, _ = tier_env(path=tmp_path / "a")
    assert tier.stores[0].io_stats().write_mode == "direct"
    url = str(tmp_path / "b")
    tier, _, _ = tier_env(path=url, store_options={url: {"write_mode": "buffered"}})
    assert tier.stores[0].io_stats().write_mode == "buffered"


def _o_direct_asked(monkeypatch):
    """The descriptors O_DIRECT is asked for from now on (through whatever fcntl is in place)."""
    asked = []
    fcntl = fastread.fcntl.fcntl

    def counted(fd, cmd, arg=0):
        if cmd == fastread.fcntl.F_SETFL and arg & fastread.O_DIRECT:
            asked.append(fd)
        return fcntl(fd, cmd, arg)

    monkeypatch.setattr(fastread.fcntl, "fcntl", counted)
    return asked


def test_a_directory_refusing_o_direct_still_gets_exact_chunks(tier_env, monkeypatch):
    # Some FUSE and network mounts refuse O_DIRECT: the tier's direct writes (its default)
    # then go through the page cache, and the chunks round-trip byte for byte.
    real_fcntl = fastread.fcntl.fcntl
    refuse_o_direct(monkeypatch)
    asked = _o_direct_asked(monkeypatch)
    tier, mem, _ = tier_env()
    assert tier.stores[0].io_stats().write_mode == "direct"
    request = make_request(PROMPT, "no-odirect")
    ctx, keys, results = _store_prompt(tier, mem, request, [0, 1, 2, 3])
    assert [r.success for r in results] == [True]
    assert len(asked) >= 4  # every chunk asked for O_DIRECT and was refused
    monkeypatch.setattr(fastread.fcntl, "fcntl", real_fcntl)
    tier.submit_load(job(keys, [8, 9, 10, 11], ctx, promotion=True))
    (loaded,) = finish(tier)
    assert loaded.success and torch.equal(mem[8:12], mem[0:4])


def test_cold_chunks_load_around_the_page_cache_and_are_scattered_once(
    tier_env, monkeypatch, tmp_path
):
    if not _takes_o_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    tier, mem, _ = tier_env()
    request = make_request(PROMPT, "cold")
    ctx, keys, results = _store_prompt(tier, mem, request, [0, 1, 2, 3])
    assert [r.success for r in results] == [True]
    scattered = []
    from_payload = tier.primary.from_payload

    def counted(payload, slot):
        scattered.append(len(payload))
        from_payload(payload, slot)

    monkeypatch.setattr(tier.primary, "from_payload", counted)
    # Cold files (written around the page cache, then dropped from it): the tier's
    # page-aligned buffers take them with O_DIRECT (read_mode "auto"), and each payload is
    # scattered once.
    _files_read_as_cold(monkeypatch)
    tier.submit_load(job(keys, [8, 9, 10, 11], ctx, promotion=True))
    (loaded,) = finish(tier)
    assert loaded.success and torch.equal(mem[8:12], mem[0:4])
    stats = tier.stores[0].io_stats()
    assert (stats.direct_reads, stats.cached_reads) == (4, 0)
    assert scattered == [tier.primary.layout.payload_size] * 4


@pytest.mark.parametrize("huge_pages", [False, True], ids=["plain-pages", "placed-for-huge-pages"])
def test_chunks_go_around_the_page_cache_from_either_kind_of_buffer(
    tier_env, monkeypatch, tmp_path, huge_pages
):
    # The test model's chunks (36 KiB) are smaller than a real huge page, and hosts
    # without THP map no huge-page buffers: a "huge page" of 4 pages here places every buffer
    # as a huge one is placed (payload on its boundary, the buffer part-way into its mapping)
    # on any host. Either way the chunks go around the page cache both ways and, once the
    # tier is shut down, every mapping it made is unmapped (no view of one outlives its job).
    if not _takes_o_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    fake_huge = 4 * buffers_module.PAGE
    monkeypatch.setattr(buffers_module, "huge_page_size", lambda: fake_huge if huge_pages else None)
    mappings = []
    map_one = buffers_module.ChunkBuffers._map_one

    def recorded(pool):
        buffer = map_one(pool)
        mappings.append(buffer.obj)
        return buffer

    monkeypatch.setattr(buffers_module.ChunkBuffers, "_map_one", recorded)
    direct_writes = _o_direct_asked(monkeypatch)
    tier, mem, _ = tier_env()
    assert tier._buffers.huge_pages is huge_pages
    (buffer,) = tier._buffers.take(1)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    if huge_pages:
        assert (start + tier.primary.layout.data_offset) % fake_huge == 0
    else:
        assert len(buffer) == len(buffer.obj)  # the buffer is its whole mapping
    tier._buffers.give([buffer])
    request = make_request(PROMPT, f"either-{huge_pages}")
    ctx, keys, results = _store_prompt(tier, mem, request, [0, 1, 2, 3])
    assert [r.success for r in results] == [True]
    assert len(direct_writes) == 4  # each chunk written with O_DIRECT from its buffer
    _files_read_as_cold(monkeypatch)
    tier.submit_load(job(keys, [8, 9, 10, 11], ctx, promotion=True))
    (loaded,) = finish(tier)
    assert loaded.success and torch.equal(mem[8:12], mem[0:4])
    assert tier.stores[0].io_stats().direct_reads == 4
    tier.shutdown()
    assert mappings and all(m.closed for m in mappings)


def _files_read_as_cold(monkeypatch):
    """Make every chunk file read as cold, as a file written long ago is.

    Just after an O_DIRECT write, ext4 here sometimes answers the non-blocking read of a
    file's first page from memory, even with no chunkstore code (7 of 20 bare
    ``os.write`` calls in one probe), so "written around the page cache" alone does not
    make a file cold. What the tier does with a cold file is what these tests check."""
    monkeypatch.setattr(fastread.ChunkFileReader, "_cached", lambda self: False)


def _takes_o_direct(directory):
    """Whether ``directory``'s filesystem accepts O_DIRECT writes (tmpfs before Linux 6.6,
    some FUSE and network mounts do not)."""
    path = directory / "probe-o-direct"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    path.unlink()
    return hasattr(os, "O_DIRECT")


@pytest.mark.parametrize(("cores", "at_once"), [(1, 1), (2, 1), (3, 2)])
def test_conversions_leave_a_core_to_the_threads_writing(tier_env, monkeypatch, cores, at_once):
    # With as many conversions as cores, the writes of a burst would wait for a core to
    # start: one core is left to the stores' threads, where there are two.
    import chunkstore.vllm.native.tier as tier_module

    monkeypatch.setattr(tier_module, "_cores", lambda: cores)
    tier, mem, _ = tier_env(slots=16, threads=4)
    assert tier.max_converting == at_once
    converting = _Gauge()
    to_payload = tier.primary.to_payload

    def slow(slot, payload):
        converting.add(1)
        try:
            # Give a second conversion the time to join, once: where the bound allows one,
            # until it has (however slow the host), else a while (it must not get in).
            deadline = time.monotonic() + (30 if at_once > 1 else 0.2)
            while converting.most < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            to_payload(slot, payload)
        finally:
            converting.add(-1)

    monkeypatch.setattr(tier.primary, "to_payload", slow)
    ctx, keys = _twelve_chunks_in_slots(tier, mem, f"cores-{cores}", seed=35)
    for first in (0, 2):
        tier.submit_store(job(keys[first : first + 2], [first, first + 1], ctx, promotion=False))
    results = finish(tier)
    assert len(results) == 2 and all(r.success for r in results)
    assert converting.most == at_once


def test_a_store_stalling_in_its_set_aside_does_not_hold_the_load_job(tier_env, tmp_path):
    # A store opened with verify=False returns a damaged chunk unchecked; the tier's own
    # check finds it and the store sets its copy aside. That set-aside (a rename on a mount,
    # requests to S3 or a peer) used to run on the load job's thread: a store stalling in it
    # held the job, and its permits, however long it stalled.
    tier, mem, ctx, keys, path = _one_flipped_chunk_unverified(tier_env, tmp_path, "aside")
    (store,) = tier.stores
    release = threading.Event()
    entered = threading.Event()
    real = store._quarantine

    def stalled(*args, **kwargs):
        entered.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    store._quarantine = stalled  # type: ignore[method-assign]
    sentinel = torch.full((SLOT_BYTES,), 0xA5, dtype=torch.uint8)
    mem[6] = sentinel
    tier.submit_load(job(keys, [6], ctx, promotion=True))
    (result,) = finish(tier)  # returns while the set-aside still waits
    assert not result.success and tier.corrupt == 1
    assert torch.equal(mem[6], sentinel)
    assert entered.wait(10) and path.exists()  # set aside later, on the store's guard
    release.set()
    deadline = time.monotonic() + 10
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not path.exists()
