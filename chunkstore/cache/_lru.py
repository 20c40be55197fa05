"""Least-recently-used replacement: the baseline every other policy is compared with."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from chunkstore.cache.policy import CachePolicy, CanEvict, NoEvictableEntry, first_evictable


class LRUPolicy(CachePolicy):
    """Evicts the resident key read or admitted longest ago.

    One :class:`~collections.OrderedDict`, oldest first: a hit is one C-level
    ``move_to_end``, an eviction one ``popitem``, so the hot path allocates
    nothing per lookup.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._entries: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))

    def hit(self, key: Hashable) -> bool:
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            return True
        return False

    def admit(
        self, key: Hashable, can_evict: CanEvict | None = None, *, parent: Hashable | None = None
    ) -> Hashable | None:
        entries = self._entries
        victim = None
        if len(entries) >= self.capacity:
            victim = first_evictable(entries, can_evict)
            if victim is None:
                raise NoEvictableEntry(f"all {len(entries)} resident entries are pinned")
            del entries[victim]
        entries[key] = None
        return victim

    def remove(self, key: Hashable) -> bool:
        return self._entries.pop(key, _ABSENT) is not _ABSENT

    def access(self, key: Hashable, parent: Hashable | None = None) -> bool:
        # Inlined hit/admit: the simulator calls this hundreds of thousands of times.
        entries = self._entries
        if key in entries:
            entries.move_to_end(key)
            return True
        if len(entries) >= self.capacity:
            entries.popitem(last=False)
        entries[key] = None
        return False


_ABSENT = object()
