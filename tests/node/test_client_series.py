"""A node service's per-client chunk counts stay bounded however many engines come and go,
and their sum over clients never goes down (docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from chunkstore.node._clientseries import DETACHED, NodeClientSeries
from chunkstore.peer import PeerMetrics
from chunkstore.peer._accounting import ServerAccounting

FAMILY = "chunkstore_node_client_chunks_total"


def clients_counted(metrics: PeerMetrics) -> dict[str, float]:
    """Per ``client`` label: its hits."""
    return {
        sample.labels["client"]: sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == FAMILY and sample.labels["result"] == "hit"
    }


def test_many_short_lived_engines_leave_a_bounded_number_of_series() -> None:
    metrics = PeerMetrics(CollectorRegistry())
    accounting = ServerAccounting(
        metrics, lambda: "node", client_series=NodeClientSeries(metrics, lambda: "node")
    )
    for i in range(200):  # engines that each attach, read one chunk, and go
        accounting.node_clients({"long-lived": 1, f"engine-{i}": 1})
        accounting.client_served(f"engine-{i}", 1, 0)
        accounting.client_served("long-lived", 1, 0)
        accounting.node_clients({"long-lived": 1})
    counted = clients_counted(metrics)
    assert len(counted) <= 64 + 2  # the newest detached, the long-lived one, and "detached"
    assert counted["long-lived"] == 200
    assert sum(counted.values()) == 400  # nothing lost: folded into client="detached"
    assert counted["engine-199"] == 1  # the latest keep their own series


def test_a_detached_engine_keeps_its_series_through_the_grace_period() -> None:
    now = [0.0]
    metrics = PeerMetrics(CollectorRegistry())
    series = NodeClientSeries(metrics, lambda: "node", grace_s=300.0, clock=lambda: now[0])
    accounting = ServerAccounting(metrics, lambda: "node", client_series=series)
    accounting.node_clients({"a": 1, "b": 1})
    accounting.client_served("a", 3, 1)
    accounting.client_served("b", 2, 0)
    accounting.node_clients({"b": 1})  # a detaches
    accounting.client_served("a", 1, 0)  # a request it made just before: still its own
    now[0] = 299.0
    assert series.retire() == 0
    assert clients_counted(metrics) == {"a": 4, "b": 2}  # a scrape meanwhile sees a's last
    now[0] = 300.0
    assert series.retire() == 1
    assert clients_counted(metrics) == {"b": 2, DETACHED: 4}
    assert (
        metrics.registry.get_sample_value(
            FAMILY, {"server": "node", "client": DETACHED, "result": "miss"}
        )
        == 1
    )
    accounting.client_served("a", 1, 0)  # later still: where its earlier counts went
    assert clients_counted(metrics) == {"b": 2, DETACHED: 5}


def test_an_engine_back_within_its_grace_period_keeps_its_series() -> None:
    now = [0.0]
    metrics = PeerMetrics(CollectorRegistry())
    series = NodeClientSeries(metrics, lambda: "node", grace_s=300.0, clock=lambda: now[0])
    accounting = ServerAccounting(metrics, lambda: "node", client_series=series)
    accounting.node_clients({"a": 1})
    accounting.client_served("a", 2, 0)
    accounting.node_clients({})
    now[0] = 100.0
    accounting.node_clients({"a": 1})  # a restarted engine with the same name
    now[0] = 1000.0
    assert series.retire() == 0
    accounting.client_served("a", 1, 0)
    assert clients_counted(metrics) == {"a": 3}
