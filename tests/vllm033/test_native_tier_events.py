"""ChunkStoreTier.take_events: stored chunks as vLLM OffloadingEvents (STORAGE, never removed)."""

from __future__ import annotations

import pytest
from vllm.v1.kv_offload.base import Locality, Medium

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

PROMPT = sample_prompt_ids(300, seed=41)


@pytest.fixture
def tier_env(harness, tmp_path):
    made = []

    def make(**options):
        mem = primary()
        tier = make_tier(harness(), mem, [str(tmp_path / "kv")], **options)
        made.append(tier)
        return tier, mem

    yield make
    for tier in made:
        tier.shutdown()


def store(tier, mem, request, slots):
    ctx = announce(tier, request)
    keys = offload_keys(request, ctx, len(slots))
    for i, slot in enumerate(slots):
        mem[slot] = nhd_slot(list(request.all_token_ids), i * CHUNK_TOKENS)
    tier.submit_store(job(keys, slots, ctx, promotion=False))
    return keys, finish(tier)


def test_a_finished_store_job_is_one_stored_event_of_its_keys(tier_env):
    tier, mem = tier_env(events=True, enable_kv_events=True, locality="REMOTE")
    keys, results = store(tier, mem, make_request(PROMPT, "ev"), [0, 1, 2, 3])
    assert [r.success for r in results] == [True]
    (event,) = list(tier.take_events())
    assert event.keys == keys and event.medium is Medium.STORAGE and not event.removed
    assert event.locality is Locality.REMOTE and event.ownership == "ChunkStoreTier"
    assert list(tier.take_events()) == []


def test_a_failed_store_job_announces_nothing(tier_env, monkeypatch):
    tier, mem = tier_env(events=True, enable_kv_events=True)
    for guarded in tier.tiers:
        monkeypatch.setattr(guarded.store, "put_if_absent_many", _refuse)
    keys, results = store(tier, mem, make_request(PROMPT, "fail"), [0, 1])
    assert [r.success for r in results] == [False]
    assert list(tier.take_events()) == []


@pytest.mark.parametrize(
    ("events", "enable"), [(False, True), (True, False)], ids=["vllm-off", "tier-off"]
)
def test_no_events_unless_vllm_and_the_tier_both_ask(tier_env, events, enable):
    tier, mem = tier_env(events=events, enable_kv_events=enable)
    store(tier, mem, make_request(PROMPT, "off"), [0, 1])
    assert tier.events is None and list(tier.take_events()) == []


def _refuse(items):
    raise OSError("disk gone")
