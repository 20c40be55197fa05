"""The connector's counters, without vLLM. The worker and scheduler halves count here.

:class:`~chunkstore.vllm.stats.ChunkStoreStats` wraps a :class:`Counters`'
data for vLLM's logging and Prometheus hooks. The counting itself stays free of
vLLM. So worker code can run in processes that never import it, such as tests
with simulated TP ranks.
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
    """Counters since the last report (every name of :data:`COUNTERS`, starting at 0)."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        """Counter name -> value."""

    def add(self, name: str, value: float = 1) -> None:
        """Add ``value`` to counter ``name``."""
        self.data[name] = self.data.get(name, 0) + value

    def is_empty(self) -> bool:
        """Whether nothing was counted."""
        return not any(self.data.values())

    def take(self) -> dict[str, float] | None:
        """The counts so far, and start again from zero. None if empty."""
        if self.is_empty():
            return None
        data, self.data = self.data, dict.fromkeys(COUNTERS, 0)
        return data
