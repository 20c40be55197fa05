"""One engine cache per engine and process, shared by the connectors that serve it.

The scheduler and worker connectors of one engine may live in one process. They then
share one :class:`~chunkstore.tiering.ProcessCache` (or node cache) by the engine's id:
:func:`acquire_shared` makes it on first use, and its last user's :func:`release_shared`
closes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

__all__ = ["SharedCache", "acquire_shared", "flush_shared", "release_shared", "shared_names"]


class SharedCache(Protocol):
    """What the per-process registry needs: a :class:`~chunkstore.tiering.ProcessCache`, or a
    :class:`~chunkstore.node._engine.NodeCache`."""

    closed: bool

    def flush(self, timeout: float | None = None) -> None:
        """Wait until what was saved so far is written behind."""
        ...

    def close(self) -> None:
        """Release what the store holds."""
        ...


S = TypeVar("S", bound=SharedCache)


@dataclass
class _SharedEntry:
    """One shared store and how many connectors use it."""

    store: SharedCache
    users: int = 0


# The registry the rule "every resource has one owner" allows: keyed by name, reference-counted,
# the store (host pool, tier threads, assembly owner, /dev/shm file) closed by its last user.
_SHARED: dict[str, _SharedEntry] = {}
_SHARED_LOCK = threading.Lock()


def acquire_shared(name: str, factory: Callable[[], S]) -> S:
    """The process's store for ``name``, the engine id. ``factory()`` makes it on first
    use. Each call is one more user, who calls :func:`release_shared` when done.

    The scheduler and worker connectors of one engine live in the same process
    whenever TP is 1. That is always so with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    and in the engine-core process of ``vllm serve``. They share host memory this way.
    """
    with _SHARED_LOCK:
        entry = _SHARED.get(name)
        if entry is None or entry.store.closed:
            entry = _SharedEntry(factory())
            _SHARED[name] = entry
        entry.users += 1
        return cast(S, entry.store)


def release_shared(name: str) -> None:
    """One user of the shared store ``name`` is done with it; the last one closes it (which
    removes its shared host pool from ``/dev/shm``). Unknown names are ignored."""
    with _SHARED_LOCK:
        entry = _SHARED.get(name)
        if entry is None:
            return
        entry.users -= 1
        if entry.users > 0:
            return
        del _SHARED[name]
    entry.store.close()


def shared_names() -> list[str]:
    """The names of the shared stores open in this process. Empty once every engine shut down."""
    with _SHARED_LOCK:
        return sorted(_SHARED)


def flush_shared(timeout: float | None = None) -> None:
    """Wait for the write-behind of every shared store of this process (tests, benchmarks)."""
    with _SHARED_LOCK:
        stores = [entry.store for entry in _SHARED.values()]
    for store in stores:
        store.flush(timeout=timeout)
