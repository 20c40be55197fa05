"""A per-process registry of engine caches, shared by the connectors of one engine.

The scheduler and worker connectors of one engine may live in one process.
They then share one cache, keyed by the engine's id. The cache is a
:class:`~chunkstore.tiering.ProcessCache` or a node cache.
:func:`acquire_shared` makes it on first use. The last user's
:func:`release_shared` closes it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

__all__ = ["SharedCache", "acquire_shared", "flush_shared", "release_shared", "shared_names"]


class SharedCache(Protocol):
    """What the registry needs of a shared cache.

    Both :class:`~chunkstore.tiering.ProcessCache` and
    :class:`~chunkstore.node._engine.NodeCache` provide it.
    """

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


# The rule "every resource has one owner" allows this registry. It is keyed by name and
# reference-counted. The last user closes the store: host pool, tier threads,
# assembly owner and /dev/shm file.
_SHARED: dict[str, _SharedEntry] = {}
_SHARED_LOCK = threading.Lock()


def acquire_shared(name: str, factory: Callable[[], S]) -> S:
    """The process's store for ``name``, the engine id.

    ``factory()`` makes the store on first use. Each call adds one user. Each
    user calls :func:`release_shared` when done.

    At TP=1, one engine's scheduler and worker connectors share a process.
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` always puts them in one process.
    So does the engine-core process of ``vllm serve``. The two connectors
    share host memory through this store.
    """
    with _SHARED_LOCK:
        entry = _SHARED.get(name)
        if entry is None or entry.store.closed:
            entry = _SharedEntry(factory())
            _SHARED[name] = entry
        entry.users += 1
        return cast(S, entry.store)


def release_shared(name: str) -> None:
    """Drop one user of the shared store ``name``.

    The last user closes the store. Closing removes its shared host pool from
    ``/dev/shm``. Unknown names are ignored.
    """
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
    """The names of the shared stores open in this process.

    The result is empty once every engine has shut down.
    """
    with _SHARED_LOCK:
        return sorted(_SHARED)


def flush_shared(timeout: float | None = None) -> None:
    """Wait for the write-behind of every shared store in this process."""
    with _SHARED_LOCK:
        stores = [entry.store for entry in _SHARED.values()]
    for store in stores:
        store.flush(timeout=timeout)
