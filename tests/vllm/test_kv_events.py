"""ChunkStoreConnector's KV events through vLLM's own publisher (``--kv-events-config``)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from vllm.config.kv_events import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from chunkstore.events import EventSubscriber, PrefixIndex  # noqa: E402
from chunkstore.vllm.testing import sample_prompt_ids  # noqa: E402

from .harness import harnesses  # noqa: E402

PROMPT = sample_prompt_ids(300, seed=1)  # 4 full chunks of 64 tokens, 2 blocks of 32 each
BPC = 2


@pytest.fixture
def harness(tiny_model):
    with harnesses(tiny_model) as make:
        yield make


@pytest.fixture
def events(tmp_path):
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/kv-events",
        replay_endpoint=f"ipc://{tmp_path}/kv-replay",
        topic="kv",
    )
    sub = EventSubscriber(config.endpoint, replay_endpoint=config.replay_endpoint, topic="kv")
    yield config, sub
    sub.close()


def collect(sub, index, decoded, until, rounds=50):
    """Read batches (catching up first) until ``until()`` holds or ``rounds`` reads passed."""
    for received in sub.catch_up():
        index.apply("engine", received)
        decoded.append(msgspec.msgpack.decode(received.payload, type=KVEventBatch))
    for _ in range(rounds):
        if until():
            return
        for received in sub.receive(timeout=0.1):
            index.apply("engine", received)
            decoded.append(msgspec.msgpack.decode(received.payload, type=KVEventBatch))


def join_live(h, sub, index):
    """Publish empty batches, as a quiet engine would, until one arrives live: the subscriber's
    socket has joined the engine's publisher, which drops what it sends before then."""
    for _ in range(100):
        h.scheduler.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[]))
        got = sub.receive(timeout=0.1)
        for received in got:
            index.apply("engine", received)
        if got:
            return
    raise AssertionError("the subscriber never joined the engine's publisher")


def hashes(request):
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def cpu_run(index, blocks):
    """Leading ``blocks`` the index says the engine holds in CPU memory."""
    return max([n for n, _, where in index.longest_prefix(blocks) if where == "CPU"], default=0)


def saved_prompt(harness, events):
    """An engine that ran PROMPT and saved its 4 chunks, and what its subscriber received
    until its index held them in CPU memory: (harness, subscriber, request, index, batches)."""
    config, sub = events
    h = harness(kv_events=config)
    request = h.add(PROMPT)
    h.run()
    index, decoded = PrefixIndex(), []
    collect(sub, index, decoded, lambda: index.count("engine", "CPU") >= 4 * BPC)
    return h, sub, request, index, decoded


def events_of(decoded, kind, medium):
    return [e for b in decoded for e in b.events if isinstance(e, kind) and e.medium == medium]


def test_saved_chunks_are_announced_in_cpu_with_vllm_block_hashes(harness, events):
    h, sub, request, index, decoded = saved_prompt(harness, events)
    stored = events_of(decoded, BlockStored, "CPU")
    assert len(stored) == 4  # one event per chunk
    blocks = hashes(request)
    for i, event in enumerate(stored):
        assert event.block_hashes == blocks[BPC * i : BPC * (i + 1)]
        assert event.parent_block_hash == (blocks[BPC * i - 1] if i else None)
        assert event.token_ids == PROMPT[64 * i : 64 * (i + 1)]
        assert event.block_size == 32
        assert event.locality == "LOCAL" and event.ownership == "host"
        assert (event.group_idx, event.kv_cache_spec_kind) == (0, "full_attention")
    # The router's join: the GPU's blocks and chunkstore's, under the same hashes.
    found = {(where, n) for n, _, where in index.longest_prefix(blocks)}
    assert ("CPU", 4 * BPC) in found
    assert any(where == "GPU" for where, _ in found)
    assert sub.lost == 0


def test_host_evictions_are_removals_and_the_index_matches_host_memory(harness, events):
    config, sub = events
    probe = harness()
    slot = probe.connector.engine.layout.total_size
    h = harness(kv_events=config, extra={"host_cache": str(2 * slot)})
    request = h.add(PROMPT)
    h.run()
    index, decoded = PrefixIndex(), []
    collect(sub, index, decoded, lambda: bool(events_of(decoded, BlockRemoved, "CPU")))
    removed = events_of(decoded, BlockRemoved, "CPU")
    assert removed
    blocks = hashes(request)
    store = h.connector.store
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    held = {
        tuple(blocks[BPC * i : BPC * (i + 1)]) for i, k in enumerate(keys) if store.host.contains(k)
    }
    assert len(held) == 2
    announced = {
        tuple(blocks[BPC * i : BPC * (i + 1)])
        for i in range(4)
        if cpu_run(index, blocks[BPC * i : BPC * (i + 1)]) == BPC
    }
    assert announced == held


def test_reset_cache_removes_what_was_announced(harness, events):
    h, sub, request, index, decoded = saved_prompt(harness, events)
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    h.step()  # the step that publishes what the reset did
    collect(sub, index, decoded, lambda: bool(events_of(decoded, BlockRemoved, "CPU")))
    assert index.count("engine", "CPU") == 0
    assert cpu_run(index, hashes(request)) == 0


def test_tier_writes_are_announced_in_storage_and_never_removed(harness, events, tmp_path):
    config, sub = events
    h = harness(kv_events=config, extra={"tiers": [f"file://{tmp_path}/kv"]})
    request = h.add(PROMPT)
    h.run()
    h.connector.store.flush(timeout=30)
    h.step()  # publishes the write-backs that finished
    index, decoded = PrefixIndex(), []
    collect(sub, index, decoded, lambda: index.count("engine", "STORAGE") >= 4 * BPC)
    stored = events_of(decoded, BlockStored, "STORAGE")
    assert [e.block_hashes for e in stored] == [
        hashes(request)[BPC * i : BPC * (i + 1)] for i in range(4)
    ]
    assert len({e.ownership for e in stored}) == 1 and stored[0].locality is None
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    h.step()
    collect(sub, index, decoded, lambda: bool(events_of(decoded, BlockRemoved, "CPU")))
    assert not events_of(decoded, BlockRemoved, "STORAGE")
    assert index.count("engine", "STORAGE") == 4 * BPC


def test_no_events_without_kv_events_config(harness):
    h = harness()
    h.add(PROMPT)
    h.run()
    assert h.connector.events is None
    assert list(h.connector.take_events()) == []


def test_a_dropped_subscriber_replays_what_it_missed(harness, events):
    config, sub = events
    h = harness(kv_events=config)
    first = h.add(PROMPT)
    h.run()
    index, decoded = PrefixIndex(), []
    collect(sub, index, decoded, lambda: index.count("engine", "CPU") >= 4 * BPC)
    sub._sub.close(0)  # the subscriber drops off while the engine goes on
    other = sample_prompt_ids(300, seed=2)
    missed = h.add(other)
    h.run()
    sub.connect()
    later = h.add(sample_prompt_ids(300, seed=3))  # live batches after the gap reveal it
    h.run()
    collect(sub, index, decoded, lambda: cpu_run(index, hashes(later)) == 4 * BPC)
    assert sub.replayed > 0 and sub.lost == 0
    for request in (first, missed, later):
        assert cpu_run(index, hashes(request)) == 4 * BPC


def test_a_restarted_engine_is_seen_and_its_old_blocks_forgotten(harness, events):
    config, sub = events
    h = harness(kv_events=config)
    first = h.add(PROMPT)
    h.run()
    index, decoded = PrefixIndex(), []
    collect(sub, index, decoded, lambda: index.count("engine", "CPU") >= 4 * BPC)
    # The engine may have run before the subscriber's socket joined (catch_up replayed its
    # batches): PUB drops what it sends before then, so join before the batches below.
    join_live(h, sub, index)
    # A longer first life: the new publisher's numbers start at 0, and a first batch that
    # arrives numbered exactly where the old one stopped would read as a continuation (the
    # batches before it dropped while the subscriber reconnected; see docs/limits.md).
    assert sub.expected is not None
    ends = sub.expected + 40
    for _ in range(40):
        h.scheduler.kv_event_publisher.publish(KVEventBatch(ts=0.0, events=[]))
    deadline = time.monotonic() + 60
    while (sub.expected or 0) < ends and time.monotonic() < deadline:
        for received in sub.receive(timeout=0.1):
            index.apply("engine", received)
    h.worker.shutdown()
    h.connector.shutdown()
    h.scheduler.shutdown()  # the engine stops: its publisher goes, with its sequence
    h = harness(kv_events=config)
    join_live(h, sub, index)
    second = h.add(sample_prompt_ids(300, seed=4))
    h.run()
    collect(sub, index, decoded, lambda: cpu_run(index, hashes(second)) == 4 * BPC)
    assert sub.restarts == 1, (sub.expected, sub.lost, sub.replayed)
    assert cpu_run(index, hashes(first)) == 0
    assert cpu_run(index, hashes(second)) == 4 * BPC


def test_a_hybrid_models_chunks_are_announced_for_each_kv_cache_group(harness, events):
    """A chunk holds every group's KV for its tokens: one event per group, as the GPU's."""
    config, sub = events
    h = harness(kv_events=config, sliding_window=1024)  # wide enough that no block is dropped
    request = h.add(PROMPT)
    h.run()
    index, decoded = PrefixIndex(), []
    collect(sub, index, decoded, lambda: len(events_of(decoded, BlockStored, "CPU")) >= 8)
    stored = events_of(decoded, BlockStored, "CPU")
    assert len(stored) == 8  # 4 chunks, 2 groups
    blocks = hashes(request)
    chunks = [blocks[BPC * i : BPC * (i + 1)] for i in range(4)]
    described = {}
    for group in (0, 1):
        of_group = [e for e in stored if e.group_idx == group]
        assert [e.block_hashes for e in of_group] == chunks
        assert [e.token_ids for e in of_group] == [PROMPT[64 * i : 64 * (i + 1)] for i in range(4)]
        (described[group],) = {
            (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in of_group
        }
    assert described == {0: ("full_attention", None), 1: ("sliding_window", 1024)}
    gpu = {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
        for e in events_of(decoded, BlockStored, "GPU")
    }
    assert gpu == {(g, *d) for g, d in described.items()}  # described as vLLM describes them
    assert h.scheduler.reset_prefix_cache(reset_connector=True)
    h.step()
    collect(sub, index, decoded, lambda: len(events_of(decoded, BlockRemoved, "CPU")) >= 8)
    removed = events_of(decoded, BlockRemoved, "CPU")
    assert sorted((e.group_idx, tuple(e.block_hashes)) for e in removed) == sorted(
        (g, tuple(c)) for g in (0, 1) for c in chunks
    )


def test_hashes_finer_than_blocks_announce_each_block_as_vllms_gpu_events_name_it(harness, events):
    """With ``hash_block_size`` below the block size (a hybrid model's ``prefix_match_unit``),
    a block's hash is the last fine hash inside it: the hashes vLLM's GPU events carry."""
    config, sub = events
    h = harness(kv_events=config, sliding_window=1024, hash_block_size=16)
    request = h.add(PROMPT)
    h.run()
    index, decoded = PrefixIndex(), []
    collect(sub, index, decoded, lambda: len(events_of(decoded, BlockStored, "CPU")) >= 8)
    fine = hashes(request)
    blocks = fine[1::2]  # 16-token hashes, 32-token blocks: every second one ends a block
    assert len(blocks) >= 4 * BPC
    chunks = [blocks[BPC * i : BPC * (i + 1)] for i in range(4)]
    stored = events_of(decoded, BlockStored, "CPU")
    gpu = events_of(decoded, BlockStored, "GPU")
    for group in (0, 1):
        of_group = [e for e in stored if e.group_idx == group]
        assert [e.block_hashes for e in of_group] == chunks
        assert [e.parent_block_hash for e in of_group] == [None] + [c[-1] for c in chunks[:-1]]
        assert [e.token_ids for e in of_group] == [PROMPT[64 * i : 64 * (i + 1)] for i in range(4)]
        gpu_blocks = [b for e in gpu if e.group_idx == group for b in e.block_hashes]
        assert gpu_blocks[: 4 * BPC] == blocks[: 4 * BPC]  # vLLM names the blocks the same
    assert h.connector.events is not None and h.connector.events.unmapped == 0


def test_hashes_that_do_not_tile_the_blocks_are_counted_unmapped_not_announced(tiny_model):
    """A request whose hashes are finer than ``hash_block_size`` says, or a
    ``hash_block_size`` that does not divide the block size, maps no chunk."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from chunkstore.hashing import ChunkKey
    from chunkstore.vllm.events import ConnectorEvents, tier_mediums

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1)
    fine = Request("fine", PROMPT, params, None, block_hasher=get_request_block_hasher(16, sha256))
    keys = [ChunkKey(bytes([i]) * 32, "0" * 16) for i in range(4)]
    for hash_block_size in (32, 24):  # the request's hashes span 16 tokens
        events = ConnectorEvents(
            block_size=32,
            blocks_per_chunk=BPC,
            mediums=tier_mediums("host", []),
            hash_block_size=hash_block_size,
        )
        events.remember(fine, 0, keys)
        for key in keys:
            events.buffer.chunk_stored(key, "host")
        assert events.take() == []
        assert events.unmapped == 4
    told = ConnectorEvents(
        block_size=32, blocks_per_chunk=BPC, mediums=tier_mediums("host", []), hash_block_size=16
    )
    told.remember(fine, 0, keys)
    for key in keys:
        told.buffer.chunk_stored(key, "host")
    assert [e.block_hashes for e in told.take()] == [
        hashes(fine)[1::2][BPC * i : BPC * (i + 1)] for i in range(4)
    ]
    assert told.unmapped == 0
