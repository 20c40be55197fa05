"""The /metrics endpoint, scraped over HTTP on 127.0.0.1 after a known workload."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkstore.backends._memory import MemoryStore
from chunkstore.cache import HostCache
from chunkstore.errors import ConfigError
from chunkstore.metrics import ChunkstoreMetrics, start_metrics_server
from chunkstore.testing.factories import MadeChunk
from chunkstore.testing.store_suite import corrupt_copies
from chunkstore.tiering import TieredStore
from tests.cache.conftest import LAYOUT


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_scrape_after_known_workload(chain: list[MadeChunk], metrics: ChunkstoreMetrics) -> None:
    disk = MemoryStore(name="disk")
    size = LAYOUT.total_size
    # ARC: which chunk the bursts evict (chain[0]) is part of the known workload.
    host = HostCache(LAYOUT, num_slots=4, policy="arc")
    store = TieredStore(host, [disk], metrics=metrics, tier_timeout=None)
    server = start_metrics_server(0, metrics=metrics)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        # Two bursts that each fit in host memory: 6 chunks written, 2 evicted.
        store.put_many([(c.key, c.data) for c in chain[:4]])
        assert store.flush(timeout=30)
        store.put_many([(c.key, c.data) for c in chain[4:6]])
        assert store.flush(timeout=30)
        assert store.get(chain[5].key) == chain[5].data  # host hit
        assert store.get(chain[0].key) == chain[0].data  # host miss, disk hit, promoted
        assert store.get(chain[11].key) is None  # missing everywhere
        disk.put(chain[10].key, corrupt_copies(chain[10])["bitflip"])
        assert store.get(chain[10].key) is None  # corrupt on disk
        metrics.record_transfer("device", "write", 4096, 0.001)

        values = scrape(server.url)

        def value(name: str, **labels: str) -> float:
            return values[(name, tuple(sorted(labels.items())))]

        assert value("chunkstore_cache_hits_total", tier="host") == 1
        assert value("chunkstore_cache_misses_total", tier="host") == 3
        assert value("chunkstore_cache_hits_total", tier="disk") == 1
        assert value("chunkstore_cache_misses_total", tier="disk") == 2
        assert value("chunkstore_promotions_total", tier="disk") == 1
        assert value("chunkstore_corrupt_chunks_total", tier="disk") == 1
        assert value("chunkstore_evictions_total", tier="host") == 3
        assert value("chunkstore_host_cache_chunks", tier="host") == 4
        assert value("chunkstore_host_cache_bytes_used", tier="host") == 4 * size
        assert value("chunkstore_host_cache_bytes_capacity", tier="host") == 4 * size
        assert value("chunkstore_host_cache_pinned_slots", tier="host") == 0
        assert value("chunkstore_transfer_bytes_total", tier="disk", direction="write") == 6 * size
        assert value("chunkstore_transfer_bytes_total", tier="disk", direction="read") == size
        assert value("chunkstore_transfer_bytes_total", tier="host", direction="write") == 6 * size
        assert value("chunkstore_transfer_bytes_total", tier="host", direction="read") == size
        assert value("chunkstore_transfer_bytes_total", tier="device", direction="write") == 4096
        assert (
            value("chunkstore_transfer_latency_seconds_count", tier="disk", direction="read") == 1
        )
        assert (
            value(
                "chunkstore_transfer_throughput_bytes_per_second_count",
                tier="device",
                direction="write",
            )
            == 1
        )
        assert value("chunkstore_lookup_latency_seconds_count", tier="host") == 0
        store.lookup_prefix([c.key for c in chain[:3]])
        assert value("chunkstore_write_queue_depth", store="tiered") == 0
        assert value("chunkstore_write_queue_capacity", store="tiered") == 256
        assert value("chunkstore_tier_up", tier="disk") == 1
        after = scrape(server.url)
        assert after[("chunkstore_lookup_latency_seconds_count", (("tier", "host"),))] == 1
    finally:
        server.close()
        store.close()


def test_drops_are_exported(chain: list[MadeChunk], metrics: ChunkstoreMetrics) -> None:
    from tests.tiering.doubles import GatedStore

    gated = GatedStore("disk")
    store = TieredStore(
        HostCache(LAYOUT, num_slots=8), [gated], metrics=metrics, queue_size=1, write_batch=1
    )
    server = start_metrics_server(0, metrics=metrics)
    try:
        store.put(chain[0].key, chain[0].data)
        assert gated.entered.wait(timeout=30)
        store.put_many([(c.key, c.data) for c in chain[1:4]])  # 1 queued, 2 dropped
        values = scrape(server.url)
        key = ("chunkstore_writes_dropped_total", (("reason", "queue_full"), ("tier", "disk")))
        assert values[key] == 2
        assert values[("chunkstore_write_queue_depth", (("store", "tiered"),))] == 1
    finally:
        gated.gate.set()
        server.close()
        store.close()


def test_server_errors_are_config_errors(metrics: ChunkstoreMetrics) -> None:
    server = start_metrics_server(0, metrics=metrics)
    try:
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            start_metrics_server(server.port, metrics=metrics)
    finally:
        server.close()
    with pytest.raises(ConfigError, match="0..65535"):
        start_metrics_server(70000, metrics=metrics)
    with pytest.raises(ConfigError, match="direction"):
        metrics.record_transfer("device", "sideways", 1, 1.0)


def test_device_transfers_are_counted_by_direction(metrics: ChunkstoreMetrics) -> None:
    metrics.record_device_transfer("device_to_host", 4096, 0.002)
    metrics.record_device_transfer("device_to_host", 1024, 0.0)
    metrics.record_device_transfer("host_to_device", 8192, 0.001)
    value = metrics.registry.get_sample_value
    assert value("chunkstore_device_bytes_total", {"direction": "device_to_host"}) == 5120
    assert value("chunkstore_device_bytes_total", {"direction": "host_to_device"}) == 8192
    assert value("chunkstore_device_transfers_total", {"direction": "device_to_host"}) == 2
    assert value("chunkstore_device_transfer_seconds_count", {"direction": "device_to_host"}) == 2
    # A zero-duration copy has no throughput sample.
    assert (
        value(
            "chunkstore_device_throughput_bytes_per_second_count", {"direction": "device_to_host"}
        )
        == 1
    )
    with pytest.raises(ConfigError, match="direction"):
        metrics.record_device_transfer("load", 1, 0.1)
    with pytest.raises(ConfigError, match=">= 0"):
        metrics.record_device_transfer("host_to_device", -1, 0.1)


def test_default_metrics_is_the_process_registry() -> None:
    from prometheus_client import REGISTRY, generate_latest

    from chunkstore.metrics import default_metrics, record_device_transfer

    default = default_metrics()
    assert default is default_metrics() and default.registry is REGISTRY
    labels = {"direction": "host_to_device"}
    before = REGISTRY.get_sample_value("chunkstore_device_bytes_total", labels) or 0.0
    record_device_transfer("host_to_device", 300, 0.01)
    assert REGISTRY.get_sample_value("chunkstore_device_bytes_total", labels) == before + 300
    assert b"chunkstore_device_bytes_total" in generate_latest(REGISTRY)
