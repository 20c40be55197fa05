"""KV events of the native tier: the chunks its store jobs wrote, for vLLM's publisher.

A secondary tier yields ``OffloadingEvent`` objects from ``take_events``.
vLLM's OffloadingConnector turns each into ``BlockStored`` events under vLLM's
block hashes. The tier announces a chunk after a successful job, once every
store took it. It never announces removals. Its stores are shared. Another
engine may still use a chunk that this one no longer sees.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

__all__ = ["TierEvents"]


class TierEvents:
    """Store jobs in flight and the events of finished ones.

    The class is thread-safe.
    """

    def __init__(self, *, locality: Locality | None, ownership: str) -> None:
        self.locality = locality
        self.ownership = ownership
        self._jobs: dict[int, list[OffloadKey]] = {}
        self._events: list[OffloadingEvent] = []
        self._lock = threading.Lock()

    def submitted(self, job_id: int, keys: Collection[OffloadKey]) -> None:
        """A store job of ``keys`` started."""
        with self._lock:
            self._jobs[job_id] = list(keys)

    def finished(self, job_id: int, success: bool) -> None:
        """A job ended; a successful store job's keys become one event."""
        with self._lock:
            keys = self._jobs.pop(job_id, None)
            if success and keys:
                self._events.append(
                    OffloadingEvent(
                        keys=keys,
                        medium=Medium.STORAGE,
                        removed=False,
                        locality=self.locality,
                        ownership=self.ownership,
                    )
                )

    def take(self) -> list[Any]:
        """Events since the last call."""
        with self._lock:
            events, self._events = self._events, []
        return events
