"""Adaptive Replacement Cache, which ``parc``, the host cache's default, builds on.

The paper is Megiddo & Modha, FAST 2003, "ARC: a self-tuning, low overhead replacement
cache", Fig. 4.

Four lists, each oldest first:

* ``T1`` holds resident keys seen once recently, ``T2`` those seen at least twice.
* ``B1`` and ``B2`` hold ghost keys, with no data, recently evicted from ``T1`` and ``T2``.

``p`` is the adaptive target size of ``T1``.
A ghost hit in ``B1`` says "recency was evicted too early" and grows it.
A ghost hit in ``B2`` shrinks it.
With no pins and no deletions this class follows the paper's algorithm step by step.
The hand-traced sequences in ``tests/cache/test_arc_traces.py`` check it.

Two deliberate extensions, both no-ops on the paper's request streams:

* A victim vetoed by ``can_evict``, a pinned slot, is skipped.
  The next candidate of the same list is tried, then of the other list.
* :meth:`ARCPolicy.remove` of a deleted chunk can leave free room while ghosts exist.
  The paper never allows that.
  So REPLACE runs only when the resident lists are full.
  Ghost lists are trimmed back to the paper's bounds after every admission.
  The bounds are ``|T1|+|B1| <= c`` and a total ``<= 2c``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Any

from chunkstore.cache.policy import CachePolicy, CanEvict, NoEvictableEntry, first_evictable

_T1, _T2 = 1, 2


class ARCPolicy(CachePolicy):
    """ARC over ``capacity`` entries; see the module docstring for the algorithm."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        # ARC stores None; a subclass may keep a value per frequent key (parc: its last use).
        self.t2: OrderedDict[Hashable, Any] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self.p: float = 0.0
        """Target size of T1 (a real number in [0, capacity], as in the paper)."""
        self._irregular = False

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __iter__(self) -> Iterator[Hashable]:
        return iter([*self.t1, *self.t2])

    # --- Case I ------------------------------------------------------------------

    def hit(self, key: Hashable) -> bool:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
            return True
        if key in self.t2:
            self.t2.move_to_end(key)
            return True
        return False

    def access(self, key: Hashable, parent: Hashable | None = None) -> bool:
        # Inlined Case I: the hot path of both the simulator and host-cache hits.
        t1 = self.t1
        if key in t1:
            del t1[key]
            self.t2[key] = None
            return True
        t2 = self.t2
        if key in t2:
            t2.move_to_end(key)
            return True
        self._admit_unpinned(key)
        return False

    def _admit_unpinned(self, key: Hashable) -> Hashable | None:
        """:meth:`admit` without ``can_evict``: the same steps with nothing to skip, inlined
        (the simulator's and the benchmark's hot path; the state machine checks both)."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        c = self.capacity
        full = len(t1) + len(t2) >= c
        victim = None
        if key in b1:
            n1, n2 = len(b1), len(b2)
            p = self.p + (n2 / n1 if n2 > n1 else 1.0)
            self.p = p = p if p < c else float(c)
            del b1[key]
            if full:
                victim = self._replace_unpinned(p, False)
            t2[key] = None
        elif key in b2:
            n1, n2 = len(b1), len(b2)
            p = self.p - (n1 / n2 if n1 > n2 else 1.0)
            self.p = p = p if p > 0.0 else 0.0
            del b2[key]
            if full:
                victim = self._replace_unpinned(p, True)
            t2[key] = None
        else:
            l1 = len(t1) + len(b1)
            if l1 >= c:
                if len(t1) < c:
                    b1.popitem(last=False)
                    if full:
                        victim = self._replace_unpinned(self.p, False)
                else:
                    victim = t1.popitem(last=False)[0]
            else:
                total = l1 + len(t2) + len(b2)
                if total >= c:
                    if total >= 2 * c and b2:
                        b2.popitem(last=False)
                    if full:
                        victim = self._replace_unpinned(self.p, False)
            t1[key] = None
        if self._irregular:
            self._trim_ghosts()
        return victim

    def _replace_unpinned(self, p: float, in_b2: bool) -> Hashable:
        t1 = self.t1
        n1 = len(t1)
        if n1 and (n1 > p or (in_b2 and n1 == p) or not self.t2):
            victim = t1.popitem(last=False)[0]
            self.b1[victim] = None
        else:
            victim = self.t2.popitem(last=False)[0]
            self.b2[victim] = None
        return victim

    # --- Cases II, III, IV ---------------------------------------------------------

    def admit(
        self, key: Hashable, can_evict: CanEvict | None = None, *, parent: Hashable | None = None
    ) -> Hashable | None:
        if can_evict is None:
            return self._admit_unpinned(key)
        # Vetoes can evict from the list REPLACE did not pick: ghosts may need trimming later.
        self._irregular = True
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        c = self.capacity
        full = len(t1) + len(t2) >= c
        if key in b1:  # Case II: recency was evicted too early; grow T1's target.
            delta = len(b2) / len(b1) if len(b2) > len(b1) else 1.0
            p = min(self.p + delta, float(c))
            victim = self._choose(p, False, can_evict) if full else None
            self.p = p
            del b1[key]
            self._evict(victim)
            t2[key] = None
        elif key in b2:  # Case III: frequency was evicted too early; shrink T1's target.
            delta = len(b1) / len(b2) if len(b1) > len(b2) else 1.0
            p = max(self.p - delta, 0.0)
            victim = self._choose(p, True, can_evict) if full else None
            self.p = p
            del b2[key]
            self._evict(victim)
            t2[key] = None
        else:  # Case IV: a brand-new key.
            victim = None
            if len(t1) + len(b1) >= c:  # Case IV.A
                if len(t1) < c:
                    victim = self._choose(self.p, False, can_evict) if full else None
                    b1.popitem(last=False)
                    self._evict(victim)
                else:
                    # T1 is the whole cache and B1 is empty: drop T1's LRU without a ghost.
                    found = first_evictable(t1, can_evict)
                    if found is None:
                        raise NoEvictableEntry(f"all {len(t1)} resident entries are pinned")
                    del t1[found]
                    victim = (found, 0)
            else:  # Case IV.B
                total = len(t1) + len(t2) + len(b1) + len(b2)
                if total >= c:
                    victim = self._choose(self.p, False, can_evict) if full else None
                    if total >= 2 * c and b2:
                        b2.popitem(last=False)
                    self._evict(victim)
            t1[key] = None
        self._trim_ghosts()
        return None if victim is None else victim[0]

    def remove(self, key: Hashable) -> bool:
        self._irregular = True
        resident = (
            self.t1.pop(key, _ABSENT) is not _ABSENT or self.t2.pop(key, _ABSENT) is not _ABSENT
        )
        # A deleted chunk must not steer p later as if it had been evicted.
        self.b1.pop(key, None)
        self.b2.pop(key, None)
        return resident

    def evict(self, can_evict: CanEvict | None = None) -> Hashable | None:
        """REPLACE on its own (as for a new key): the victim leaves a ghost in B1 or B2.

        The lists' total is unchanged, so the paper's bounds still hold; the next
        admission then finds room and replaces nothing.
        """
        if not self.t1 and not self.t2:
            return None
        try:
            victim = self._choose(self.p, False, can_evict)
        except NoEvictableEntry:
            return None
        self._evict(victim)
        return victim[0]

    # --- REPLACE -------------------------------------------------------------------

    def _choose(self, p: float, in_b2: bool, can_evict: CanEvict | None) -> tuple[Hashable, int]:
        """REPLACE's victim (key, list) without moving anything; raises if all are pinned."""
        t1_len = len(self.t1)
        prefer_t1 = t1_len >= 1 and (t1_len > p or (in_b2 and t1_len == p))
        order = ((self.t1, _T1), (self.t2, _T2)) if prefer_t1 else ((self.t2, _T2), (self.t1, _T1))
        for entries, which in order:
            found = first_evictable(entries, can_evict)
            if found is not None:
                return found, which
        raise NoEvictableEntry(f"all {t1_len + len(self.t2)} resident entries are pinned")

    def _evict(self, victim: tuple[Hashable, int] | None) -> None:
        """Move REPLACE's victim from T1 to B1's MRU end, or from T2 to B2's."""
        if victim is None:
            return
        key, which = victim
        if which == _T1:
            del self.t1[key]
            self.b1[key] = None
        else:
            del self.t2[key]
            self.b2[key] = None

    def _trim_ghosts(self) -> None:
        # Only pins or deletions can push the lists past the paper's bounds.
        c = self.capacity
        b1, b2 = self.b1, self.b2
        while b1 and len(self.t1) + len(b1) > c:
            b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(b1) + len(b2) > 2 * c and (b2 or b1):
            (b2 or b1).popitem(last=False)


_ABSENT = object()
