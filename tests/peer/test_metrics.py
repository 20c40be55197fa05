"""Peer metrics go where they are injected: a private registry keeps them apart."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY, CollectorRegistry

from chunkstore.backends._memory import MemoryStore
from chunkstore.peer import PeerMetrics, PeerServer, PeerStore, default_peer_metrics
from chunkstore.testing.factories import sample_chunks

pytestmark = pytest.mark.timeout(60)


def test_server_and_store_report_to_the_metrics_they_are_given() -> None:
    registry = CollectorRegistry()
    metrics = PeerMetrics(registry)
    name = f"private-{uuid.uuid4().hex[:8]}"
    chunks = sample_chunks(2, seed=3)
    server = PeerServer(
        MemoryStore(), name=name, planes=("inline",), use_env_secret=False, metrics=metrics
    ).start()
    store = PeerStore([server.endpoint], plane="inline", use_env_secret=False, metrics=metrics)
    try:
        store.put_many([(c.key, c.data) for c in chunks])
        assert store.get_many([c.key for c in chunks]) == [c.data for c in chunks]
    finally:
        store.close()
        server.stop()
    fetched = {"server": name, "op": "fetch"}
    assert registry.get_sample_value("chunkstore_peer_server_requests_total", fetched) == 1
    assert registry.get_sample_value(
        "chunkstore_peer_server_chunks_total", {"server": name, "result": "hit"}
    ) == len(chunks)
    pushed_in = {"plane": "inline", "direction": "out"}
    assert registry.get_sample_value("chunkstore_peer_client_bytes_total", pushed_in) == sum(
        len(c.data) for c in chunks
    )
    assert REGISTRY.get_sample_value("chunkstore_peer_server_requests_total", fetched) is None


def test_the_default_peer_metrics_are_one_object_in_the_default_registry() -> None:
    assert default_peer_metrics() is default_peer_metrics()
    assert default_peer_metrics().registry is REGISTRY
