"""A set of chunk keys the garbage collector never walks.

A set of :class:`~chunkstore.hashing.ChunkKey` objects holds one GC-tracked object per
key, and even a ``set`` of ``bytes`` is walked whole by every full collection. While such a
set grows, or churns, Python runs a full collection each time a quarter as many new objects
survived as it already tracks, with every thread stopped. The store announcer holds up to
10^6 keys, and the events behind such a pause wait for it (the benchmarks page has the
times). :class:`KeySet` keeps each namespace's digests as the keys of a ``dict`` whose
values are None. CPython does not track a dict that holds only such atomic objects, so no
collection walks it. ``ChunkKey`` objects are made only when asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from chunkstore.hashing import ChunkKey

__all__ = ["KeySet"]


class KeySet:
    """A mutable set of chunk keys, as digests per namespace."""

    __slots__ = ("_by_namespace", "_size")

    def __init__(self, keys: Iterable[ChunkKey] = ()) -> None:
        self._by_namespace: dict[str, dict[bytes, None]] = {}
        self._size = 0
        self.update(keys)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, ChunkKey):
            return False
        digests = self._by_namespace.get(key.namespace)
        return digests is not None and key.digest in digests

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[ChunkKey]:
        """Every key, a namespace at a time. Changing the set while iterating raises."""
        for namespace, digests in self._by_namespace.items():
            for digest in digests:
                yield ChunkKey(digest, namespace)

    def minus(self, *others: KeySet) -> list[ChunkKey]:
        """The keys in this set and in none of ``others``."""
        out: list[ChunkKey] = []
        for namespace, digests in self._by_namespace.items():
            theirs = [o._by_namespace[namespace] for o in others if namespace in o._by_namespace]
            out += (
                ChunkKey(digest, namespace)
                for digest in digests
                if not any(digest in t for t in theirs)
            )
        return out

    def add(self, key: ChunkKey) -> None:
        digests = self._by_namespace.get(key.namespace)
        if digests is None:
            digests = self._by_namespace[key.namespace] = {}
        if key.digest not in digests:
            digests[key.digest] = None
            self._size += 1

    def discard(self, key: ChunkKey) -> None:
        digests = self._by_namespace.get(key.namespace)
        if digests is None or key.digest not in digests:
            return
        del digests[key.digest]
        self._size -= 1
        if not digests:
            del self._by_namespace[key.namespace]

    def update(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            self.add(key)

    def clear(self) -> None:
        self._by_namespace.clear()
        self._size = 0
