"""The connector's counters, which the worker and scheduler halves update.

:class:`~chunkstore.vllm.stats.ChunkStoreStats` wraps a :class:`Counters`'
data for vLLM's logging and Prometheus hooks. The counting itself needs no
vLLM. Worker code thus runs in processes that never import vLLM. Tests with
simulated TP ranks are such processes.
"""

from __future__ import annotations

__all__ = ["COUNTERS", "Counters"]

COUNTERS: dict[str, str] = {
    "lookups": "Requests looked up in the chunk store.",
    "hit_chunks_host": "Chunks found in host memory at lookup.",
    "hit_chunks_tier": "Chunks prefetched from a secondary tier into host memory.",
    "prefetch_timeouts": "Secondary-tier prefetches that ran past prefetch_timeout_s.",
    "corrupt_chunks": "Corrupt chunks detected (and treated as misses).",
    "loaded_chunks": "Chunks copied host -> device.",
    "loaded_bytes": "Bytes copied host -> device.",
    "load_seconds": "Time spent copying host -> device.",
    "load_errors": "Chunks that failed to load (vLLM recomputes them).",
    "saved_chunks": "Chunks copied device -> host and sealed.",
    "saved_bytes": "Bytes copied device -> host.",
    "save_seconds": "Time spent copying device -> host and sealing.",
    "save_errors": "Chunks whose save failed (not stored; a later request recomputes them).",
}


class Counters:
    """Counters since the last report, one per name in :data:`COUNTERS`."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        """Map from counter name to value."""

    def add(self, name: str, value: float = 1) -> None:
        """Add ``value`` to counter ``name``."""
        self.data[name] = self.data.get(name, 0) + value

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.values())

    def take(self) -> dict[str, float] | None:
        """Return the counts so far and reset them to zero; None if nothing was counted."""
        if self.is_empty():
            return None
        data, self.data = self.data, dict.fromkeys(COUNTERS, 0)
        return data
