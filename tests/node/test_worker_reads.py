"""The connector's worker over a node service: a read the service takes back during its
device copy is a failed load (recomputed), never KV used as loaded."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from chunkstore.hashing import ChunkKey  # noqa: E402
from chunkstore.vllm.testing import sample_prompt_ids  # noqa: E402
from tests.node.conftest import Node, engine_chunk_size, start_node  # noqa: E402
from tests.vllm.harness import Harness, harnesses  # noqa: E402

PROMPT = sample_prompt_ids(300, seed=21)  # 4 chunks of 64 tokens (block 32)
FULL_ATTENTION = ("model.layers.0.self_attn.attn",)


@pytest.fixture
def engine_node(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[Node, Callable[..., Harness]]]:
    """A node service with slots of the tiny model's chunks, and a maker of harnesses whose
    connector is attached to it."""
    node = start_node(tmp_path, slot_size=engine_chunk_size(tiny_model))
    try:
        with harnesses(tiny_model) as make:
            yield node, lambda **kw: make(extra={"node": node.socket}, **kw)
    finally:
        node.server.stop()
        node.store.close()


def _take_back(node: Node, client: Any, key: ChunkKey, data_offset: int) -> None:
    """What the service does when the client's session ends under a copy in flight: its pins
    go, and the slot of ``key`` is handed to another chunk, whose bytes overwrite the KV."""
    pool = node.host.pool
    with node.host.acquire(key) as lease:
        slot = lease.slot
    before = pool.generation(slot)
    node.server._sessions.end(client._peer._session)  # the connection dropped
    leases = []
    while pool.generation(slot) == before and len(leases) < pool.num_slots:
        lease = node.host.reserve(ChunkKey(bytes([len(leases)]) * 32, "00" * 8))
        assert lease is not None
        leases.append(lease)
    assert pool.generation(slot) != before
    leases[-1].view[data_offset:] = b"\x7f" * (len(leases[-1].view) - data_offset)
    for lease in leases:
        node.host.abort(lease)


def _load_with_chunk_taken_back(node: Node, h: Harness, index: int) -> Any:
    """Save the prompt, then add it again; the node takes back chunk ``index`` while it is
    loaded. Returns the new request."""
    h.add(PROMPT)
    h.run()
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    assert all(node.store.exists_many(keys))
    h.scheduler.reset_prefix_cache()
    store = h.connector.store
    original = store.read_host
    data_offset = h.connector.engine.layout.data_offset

    @contextlib.contextmanager
    def taken_back(key: ChunkKey) -> Iterator[Any]:
        with original(key) as view:
            if key == keys[index] and view is not None:
                _take_back(node, store.client, key, data_offset)
            yield view

    store.read_host = taken_back
    try:
        req = h.add(PROMPT)
        h.step()
    finally:
        store.read_host = original
    return req


def test_a_sync_load_taken_back_during_its_copy_is_recomputed(
    engine_node: tuple[Node, Callable[..., Harness]],
) -> None:
    node, make = engine_node
    h = make()
    req = _load_with_chunk_taken_back(node, h, 2)
    # Reported in the step that loaded it: truncated at that chunk, blocks 4.. recomputed.
    assert h.scheduler.requests[req.request_id].num_computed_tokens == 128
    h.step()
    assert h.device_kv_matches(req, 288)
    h.run()


def test_an_async_load_taken_back_during_its_copy_fails_its_request(
    engine_node: tuple[Node, Callable[..., Harness]],
) -> None:
    node, make = engine_node
    h = make(sliding_window=128)
    req = _load_with_chunk_taken_back(node, h, 1)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.step()  # the worker reports the receive failed: vLLM recomputes the prompt
    for _ in range(10):
        h.step()
        if req.num_computed_tokens >= 300:
            break
    assert h.device_kv_matches(req, 288, layers=FULL_ATTENTION)
    h.run()


def test_a_sync_load_still_copying_is_checked_before_the_step_reports_its_errors(
    engine_node: tuple[Node, Callable[..., Harness]],
) -> None:
    from chunkstore.device import CudaCopier
    from tests.device.fake_cuda import FakeRuntime

    node, make = engine_node
    h = make()
    runtime = FakeRuntime(pinned=True, auto_complete=True)
    worker = h.worker.worker
    assert worker is not None
    worker.register_kv_caches(h.kv, copier=CudaCopier("cpu", runtime), cpu_isa="vec")
    h.add(PROMPT)
    h.run()
    keys = h.connector.engine.keys(PROMPT, h.connector.engine.root())
    h.scheduler.reset_prefix_cache()
    runtime.auto_complete = False  # the copies of the next load stay on the "device"
    start = h.worker.start_load_kv
    data_offset = h.connector.engine.layout.data_offset

    def start_then_take_back(forward_context: Any) -> None:
        start(forward_context)
        # The copies are issued, not complete, when the service takes chunk 2's slot back.
        _take_back(node, h.connector.store.client, keys[2], data_offset)

    h.worker.start_load_kv = start_then_take_back  # type: ignore[method-assign]
    try:
        req = h.add(PROMPT)
        h.step()
    finally:
        h.worker.start_load_kv = start  # type: ignore[method-assign]
        runtime.complete_all()
        runtime.auto_complete = True
    # The step waited for those copies, checked them, and reported chunk 2 failed.
    assert h.scheduler.requests[req.request_id].num_computed_tokens == 128
    h.step()
    assert h.device_kv_matches(req, 288)
    h.run()
