"""Connector statistics for vLLM's hooks, which log them and export them to Prometheus."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from chunkstore.vllm.counters import COUNTERS

__all__ = ["COUNTERS", "ChunkStorePromMetrics", "ChunkStoreStats"]


@dataclass
class ChunkStoreStats(KVConnectorStats):
    """Counters since the last report.

    Counts from several workers or intervals aggregate by sum.
    """

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def reset(self) -> None:
        for name in COUNTERS:
            self.data[name] = 0

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        if out["load_seconds"]:
            out["load_GBps"] = round(out["loaded_bytes"] / out["load_seconds"] / 1e9, 3)
        if out["save_seconds"]:
            out["save_GBps"] = round(out["saved_bytes"] / out["save_seconds"] / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)


class ChunkStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:chunkstore_<counter>_total`` per engine, fed from :class:`ChunkStoreStats`."""

    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:chunkstore_{name}", documentation=doc, labelnames=labelnames
            )
            self.counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
