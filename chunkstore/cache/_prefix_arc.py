"""Prefix-aware ARC, "parc": ARC's balance of recency and frequency, shaped for KV prefix reuse.

The engine can only use a chunk when every chunk before it in its chain is cached too.
Only the leading run of hits of a request is skipped.
Shared shallow prefixes, such as system prompts and tool definitions, come back across
many conversations.
A conversation's next turn comes back after a think time.
That time is long compared with a small cache's turnover.
Five changes to ARC follow from that.
ARC is Megiddo & Modha 2003, see :mod:`chunkstore.cache._arc`.

* **Leaf first.** REPLACE picks the least recently used entry of T1 or T2, as ARC does.
  When that entry still has resident children, it walks down to a leaf of its subtree.
  Given a choice, it steps into a child seen only once, else the oldest.
  It evicts that leaf instead.
  A chunk is never evicted while a chunk after it stays.
  So what remains of a chain is a usable prefix rather than a useless tail.
  Shared shallow chunks, with many children, are the last to go.
* **Orphans go first.** A resident chunk whose parent is gone is an *orphan*.
  It is worth nothing until the parent returns, so it is evicted before anything else.
  The walk from the oldest entry may end at the parent of the chunk being admitted.
  That is a chain older than everything else, read once, growing.
  Then that parent goes and the new chunk is the next orphan.
  Such a chain eats its own tail rather than the rest of the cache.
  A chain longer than the cache thus keeps its head, and its tail rotates through one slot.
  Sparing that parent for another leaf loses tokens at small capacities.
  See docs/benchmarks.md, "Tokens saved on traces".
* **A long frequency memory.** ARC's ghosts hold at most ``capacity`` keys.
  That is far too short for think times.
  So the last ``history * capacity`` evicted keys are remembered too.
  One that comes back is admitted straight to T2, the list of chunks seen more than once.
  That does not move ARC's target ``p``.
  A chain reused once is likely to be reused again.
* **Faster turn to frequency.** A hit in B2 is a chunk that had been reused and was
  evicted too early.
  It shrinks ``p`` by ``frequency_step`` times ARC's step.
  On KV traces such a return is strong evidence.
  ARC's unit steps lag far behind the turnover of a small cache.
* **Idle frequent chunks expire.** ARC moves ``p`` only on ghost hits.
  So T2 may come to hold the chunks of conversations that have ended.
  Those were read many times and are never read again.
  ARC keeps them while T1 shrinks, until new turns are evicted before they come back.
  Here every T2 key carries the lookup count of its last use.
  The policy tracks how long T2 chunks stay idle before they are read again.
  The *reuse horizon* is a running estimate of the 99th percentile of those idle times.
  It is never below ``idle_floor * capacity`` lookups.
  T2's least recently used chunk may have been idle over ``idle_margin`` times the horizon.
  REPLACE then takes it, leaf first, whatever ``p`` says.
  Hardly anything on such a trace comes back after so long.
  Traces whose chunks return after long pauses push the horizon out and keep ARC's choice.
  A percentile is used rather than the longest idle time seen.
  So one late return does not switch expiry off for good.

Chain structure comes from ``parent`` in :meth:`PrefixARCPolicy.admit` and
:meth:`~PrefixARCPolicy.access`, or from :meth:`PrefixARCPolicy.link`.
The host cache reads it from each chunk's header when the chunk is committed.
Keys without a known parent are treated as chain roots.
The policy then behaves like ARC with a longer memory and idle expiry.
Pins, from ``can_evict``, are honoured.
A vetoed leaf makes REPLACE try the next candidate.
Only when no leaf can go is an inner chunk evicted.
:class:`NoEvictableEntry` is raised, state unchanged, when nothing can.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

from chunkstore.cache._arc import ARCPolicy
from chunkstore.cache.policy import CanEvict, NoEvictableEntry, first_evictable
from chunkstore.errors import ConfigError

DEFAULT_HISTORY = 2
"""Remembered evicted keys, in multiples of the capacity (picked from the simulator sweep)."""
DEFAULT_FREQUENCY_STEP = 6.0
"""How many of ARC's steps a B2 ghost hit moves ``p`` towards frequency (from the same sweep)."""
DEFAULT_IDLE_MARGIN = 2.5
"""T2's LRU chunk expires when idle for this multiple of the reuse horizon (simulator sweep)."""
DEFAULT_IDLE_FLOOR = 2
"""The reuse horizon starts at (and never falls below) this many lookups per cache entry."""
_HORIZON_QUANTILE = 0.99
_HORIZON_UP = 1.05
# A stochastic quantile estimate: up by 5 % when an idle time exceeds it, down by
# 5 % x (1 - q) / q otherwise, so it settles where a fraction q of idle times lie below.
_HORIZON_DOWN = 1 - 0.05 * (1 - _HORIZON_QUANTILE) / _HORIZON_QUANTILE


class PrefixARCPolicy(ARCPolicy):
    """Prefix-aware ARC over ``capacity`` entries. See the module docstring.

    ARC's lists, target ``p``, hits and ghost bounds are inherited.
    Admission, REPLACE and removal are its own.

    One class because its hot paths are inlined copies of its careful paths.
    Split apart, every lookup would pay a call.
    The decision digests hold both copies to one result.
    """

    name = "parc"
    follows_chains = True

    def __init__(
        self,
        capacity: int,
        history: int = DEFAULT_HISTORY,
        frequency_step: float = DEFAULT_FREQUENCY_STEP,
        idle_margin: float = DEFAULT_IDLE_MARGIN,
        idle_floor: int = DEFAULT_IDLE_FLOOR,
    ) -> None:
        super().__init__(capacity)
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ConfigError(f"history must be a non-negative multiple, got {history!r}")
        number = isinstance(frequency_step, (int, float)) and not isinstance(frequency_step, bool)
        if not number or not frequency_step >= 1:
            raise ConfigError(f"frequency_step must be a number >= 1, got {frequency_step!r}")
        self.frequency_step = float(frequency_step)
        """Multiple of ARC's step by which a B2 ghost hit shrinks ``p``."""
        margin_is_number = isinstance(idle_margin, (int, float)) and not isinstance(
            idle_margin, bool
        )
        if not margin_is_number or not idle_margin >= 1:
            raise ConfigError(
                f"idle_margin must be a number >= 1 (inf: never expire), got {idle_margin!r}"
            )
        if isinstance(idle_floor, bool) or not isinstance(idle_floor, int) or idle_floor < 0:
            raise ConfigError(f"idle_floor must be a non-negative multiple, got {idle_floor!r}")
        self.idle_margin = float(idle_margin)
        """T2's LRU chunk expires once idle for more than this multiple of the reuse horizon."""
        self._horizon_floor = float(idle_floor * capacity)
        self._horizon = max(self._horizon_floor, 1.0)
        # T2 re-reads within the horizon since it was last settled: each lowers it by one
        # down-step, applied in bulk (a counter is cheaper than a multiplication per hit).
        self._rereads_within = 0
        # Lookup count: hits and admissions tick it. T2's values are its keys' last uses;
        # T1 keys need none (only T2 keys' idle times are read, and a key entering T2 is
        # stamped), so a hit costs one dict lookup more than ARC's, not two. A float (exact to
        # 2**53 lookups): each hit replaces its key's stamp, and CPython keeps freed floats on
        # a free list where freed ints go back to the allocator's pools, a cache miss more
        # per hit (about 40 ns at 100k entries).
        self._clock = 0.0
        self.history: OrderedDict[Hashable, None] = OrderedDict()
        """The last ``history * capacity`` evicted keys, oldest first."""
        self._history_limit = history * capacity
        self._parent: dict[Hashable, Hashable] = {}
        # Each parent's resident children: the child itself when it is the only one (as along
        # a chain: no dict to build and free per link), else a _Siblings dict in the order they
        # were linked (a dict, not a set: the walk must not depend on hash order, which varies
        # between processes for str and bytes keys). (Typed Any: mypy cannot narrow a union
        # by `type(x) is not _Siblings`, and isinstance() would cost a call on every miss.)
        self._children: dict[Hashable, Any] = {}
        self._orphans: OrderedDict[Hashable, None] = OrderedDict()
        # The last walk to a leaf, as far as it went through only children: successive
        # evictions start from the same old chain head and walk it down again, a step per
        # block (24-29 steps per eviction on the Mooncake trace). Each key's index in it, so
        # that a change to the children of a key on it cuts the walk short after that key.
        self._walk: list[Hashable] = []
        self._walk_index: dict[Hashable, int] = {}

    def parent_of(self, key: Hashable) -> Hashable | None:
        """The recorded parent of a resident key (``None`` if unknown or not resident)."""
        return self._parent.get(key)

    def children_of(self, key: Hashable) -> frozenset[Hashable]:
        """Resident keys whose recorded parent is ``key`` (resident or not)."""
        return frozenset(_siblings(self._children.get(key)))

    # --- uses ----------------------------------------------------------------------------

    def hit(self, key: Hashable) -> bool:
        """ARC's Case I, plus the last-use stamp and the reuse horizon."""
        # T2 first: on a warm cache most hits are rereads of frequent keys, and its lookup
        # yields the last use too.
        t2 = self.t2
        last = t2.get(key)
        clock = self._clock
        if last is not None:
            t2.move_to_end(key)
            if clock - last > self._horizon:
                self._horizon = self.reuse_horizon * _HORIZON_UP
            else:
                self._rereads_within += 1
        elif not (t1 := self.t1) or t1.pop(key, _ABSENT) is _ABSENT:  # see access()
            return False
        t2[key] = clock
        self._clock = clock + 1.0
        return True

    @property
    def reuse_horizon(self) -> float:
        """Estimated 99th percentile of the idle times after which T2 chunks are read again.
        It counts in lookups, and is never below ``idle_floor * capacity``."""
        if self._rereads_within:
            self._settle_horizon()
        return self._horizon

    def _settle_horizon(self) -> None:
        """Apply the down-steps of the T2 rereads counted since the horizon last settled."""
        within = self._rereads_within
        self._rereads_within = 0
        self._horizon = max(self._horizon * _HORIZON_DOWN**within, self._horizon_floor)

    def access(self, key: Hashable, parent: Hashable | None = None) -> bool:
        # hit() copied in, then admit() on a miss: the simulator's and the benchmark's hot
        # path, which then makes one call per lookup, not two. The
        # decision digests (tests/cache/test_policy_decisions.py) hold both copies to one result.
        t2 = self.t2
        last = t2.get(key)
        clock = self._clock
        if last is not None:
            t2.move_to_end(key)
            if clock - last > self._horizon:
                self._horizon = self.reuse_horizon * _HORIZON_UP
            else:
                self._rereads_within += 1
        elif not (t1 := self.t1) or t1.pop(key, _ABSENT) is _ABSENT:
            # (T1 is empty on a warm cache of rereads: then a miss needs no pop call.)
            self._admit_unpinned(key, parent)
            return False
        t2[key] = clock
        self._clock = clock + 1.0
        return True

    def admit(
        self, key: Hashable, can_evict: CanEvict | None = None, *, parent: Hashable | None = None
    ) -> Hashable | None:
        if can_evict is None:
            return self._admit_unpinned(key, parent)
        c = self.capacity
        b1, b2 = self.b1, self.b2
        p = self.p
        in_b2 = False
        ghosts = None  # the ghost list that holds key (B1 and B2 never share a key)
        # (Conditional expressions rather than min/max and len calls: this runs on most misses.)
        if key in b1:  # ARC Case II: recency was evicted too early.
            g1, g2 = len(b1), len(b2)
            p += g2 / g1 if g2 > g1 else 1.0
            p = p if p < c else float(c)
            ghosts = b1
        elif key in b2:  # ARC Case III, with a longer step: frequency was evicted too early.
            g1, g2 = len(b1), len(b2)
            p -= self.frequency_step * (g1 / g2 if g1 > g2 else 1.0)
            p = p if p > 0.0 else 0.0
            in_b2 = True
            ghosts = b2
        history = self.history
        frequent = ghosts is not None or key in history
        t1, t2 = self.t1, self.t2
        victim = None
        if len(t1) + len(t2) >= c:
            victim = self._choose_victim(p, in_b2, can_evict)
        # Nothing has changed before this point: NoEvictableEntry leaves the state as it was.
        self.p = p
        if frequent:
            if ghosts is not None:
                del ghosts[key]
            history.pop(key, None)
        if victim is not None:
            self._evict_key(victim)
        self._enter(key, frequent, parent)
        return victim

    def _admit_unpinned(self, key: Hashable, parent: Hashable | None = None) -> Hashable | None:
        """:meth:`admit` with nothing vetoed: the same decisions in fewer dict operations.

        It is the hot path of :meth:`access` and of admissions without ``can_evict``.
        The simulator and the benchmark run it.
        With no veto nothing can refuse.
        REPLACE then reads neither the ghosts nor the long history.
        So the key leaves them before the victim is chosen, with one ``pop`` each.
        Without recorded chains there are no orphans and no walk.
        The victim is then the LRU entry of ARC's list, popped off its end.
        With chains, the usual victim is a leaf where REPLACE starts.
        That is an orphan just admitted, on a cache full of chains.
        It is evicted here, line by line as :meth:`_evict_key` and its helpers do it.
        The rest of the admission is :meth:`_enter`, inlined as well.
        Two tests hold it to the careful path: the decision digests of
        tests/cache/test_policy_decisions.py, and
        ``test_unpinned_admissions_decide_as_the_careful_path``.
        """
        # _evict_key's three calls are inlined here, on a miss's path. _enter stays a call:
        # inlining it made no difference measurable at 100k entries.
        c = self.capacity
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        p = self.p
        in_b2 = False
        # (Conditional expressions rather than min/max and len calls: this runs on most misses.)
        if b1 and b1.pop(key, _ABSENT) is not _ABSENT:  # ARC Case II (B1's size was one more)
            g1, g2 = len(b1) + 1, len(b2)
            p += g2 / g1 if g2 > g1 else 1.0
            self.p = p = p if p < c else float(c)
            ghost = True
        elif b2 and b2.pop(key, _ABSENT) is not _ABSENT:  # Case III, with a longer step
            g1, g2 = len(b1), len(b2) + 1
            p -= self.frequency_step * (g1 / g2 if g1 > g2 else 1.0)
            self.p = p = p if p > 0.0 else 0.0
            in_b2 = True
            ghost = True
        else:
            ghost = False
        # A ghost hit leaves the history too; any other key is frequent if it returns from it.
        history = self.history
        frequent = history.pop(key, _ABSENT) is not _ABSENT or ghost
        children, orphans = self._children, self._orphans
        victim = None
        if len(t1) + len(t2) >= c:
            if not children:
                # (With T1 empty the full cache is all T2: the call would say so, settle nothing.)
                if self._replace_from_t1(p, in_b2) if t1 else False:
                    victim = t1.popitem(last=False)[0]
                    b1[victim] = None
                else:
                    victim = t2.popitem(last=False)[0]
                    b2[victim] = None
                self._remember_evicted(victim)
            else:
                # REPLACE's first candidate: the oldest orphan, else the LRU entry of ARC's list.
                if orphans:
                    # ARC's choice is not needed then; only the horizon settles as it would.
                    if t1 and t2 and self._rereads_within:
                        self._settle_horizon()
                    victim = next(iter(orphans))
                else:
                    from_t1 = self._replace_from_t1(p, in_b2) if t1 else False
                    victim = next(iter(t1 if from_t1 else t2))
                # Walked down to a leaf, as _choose_victim does; if that loops, its search.
                leaf = victim if victim not in children else self._walk_down(victim)
                if leaf is None:
                    # (Asked again, ARC's choice is the same: nothing it reads has moved.)
                    from_t1 = self._replace_from_t1(p, in_b2) if t1 else False
                    victim = self._careful_victim(from_t1, None)
                    self._evict_key(victim)
                else:  # _evict_key, for a leaf: it has no children to orphan
                    victim = leaf
                    if not t1 or t1.pop(victim, _ABSENT) is _ABSENT:
                        del t2[victim]
                        b2[victim] = None
                    else:
                        b1[victim] = None
                    limit = self._history_limit
                    if limit:  # (_remember_evicted)
                        history[victim] = None
                        if len(history) > limit:
                            history.popitem(last=False)
                    if orphans:
                        orphans.pop(victim, None)
                    above = self._parent.pop(victim, None)
                    if above is not None:
                        if type(children[above]) is _Siblings:
                            self._unlink(victim, above)
                        else:  # (_unlink, for an only child)
                            del children[above]
                            if above in self._walk_index:
                                self._children_changed(above)
        self._enter(key, frequent, parent)
        return victim

    def _enter(self, key: Hashable, frequent: bool, parent: Hashable | None) -> None:
        """The end of an admission, once the victim is gone.
        ``key`` joins T2, stamped, if ``frequent``, else T1.
        Its resident children stop being orphans.
        It is linked, and ghosts are trimmed."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        clock = self._clock
        if frequent:
            t2[key] = clock
        else:
            t1[key] = None
        self._clock = clock + 1.0
        children = self._children
        if children:
            below = children.get(key)
            if below is not None:
                orphans = self._orphans
                if type(below) is _Siblings:
                    for child in below:
                        orphans.pop(child, None)
                else:
                    orphans.pop(below, None)
        if parent is not None and parent != key:
            self._record_parent(key, parent)
        n1, n_b1, c = len(t1), len(b1), self.capacity
        if n1 + n_b1 > c or n1 + len(t2) + n_b1 + len(b2) > 2 * c:
            self._trim_ghosts()

    def link(self, key: Hashable, parent: Hashable) -> None:
        """Record that ``parent`` precedes the resident ``key`` in its chain."""
        if key == parent or key not in self:
            return
        old = self._parent.get(key)
        if old == parent:
            return
        if old is not None:
            self._unlink(key, old)
        self._record_parent(key, parent)

    def _record_parent(self, key: Hashable, parent: Hashable) -> None:
        """Link a resident ``key`` that has no recorded parent (a new one, or just unlinked)."""
        self._parent[key] = parent
        children = self._children
        siblings = children.get(parent)
        if siblings is None:
            # (A None key, were there one, could not stand alone: get() answers None for none.)
            children[parent] = key if key is not None else _Siblings({key: None})
        elif type(siblings) is _Siblings:
            siblings[key] = None
        else:
            children[parent] = _Siblings({siblings: None, key: None})
        if parent in self._walk_index:
            self._children_changed(parent)
        orphans, t1 = self._orphans, self.t1
        if parent in self.t2 or (t1 and parent in t1):
            if orphans:  # (usually empty: no call then, as for T1)
                orphans.pop(key, None)
        else:
            orphans[key] = None

    def remove(self, key: Hashable) -> bool:
        resident = super().remove(key)
        # A deleted chunk must not come back as if it had been evicted.
        self.history.pop(key, None)
        if resident:
            self._forget(key)
        return resident

    def evict(self, can_evict: CanEvict | None = None) -> Hashable | None:
        """REPLACE on its own, leaf first: the victim leaves a ghost as after an admission."""
        if not self.t1 and not self.t2:
            return None
        try:
            victim = self._choose_victim(self.p, False, can_evict)
        except NoEvictableEntry:
            return None
        self._evict_key(victim)
        self._trim_ghosts()
        return victim

    # --- REPLACE ---------------------------------------------------------------------------

    def _walk_down(self, start: Hashable) -> Hashable | None:
        """The leaf a walk from ``start`` reaches, see :meth:`_coldest`. ``None`` if it loops.

        A walk from the same start as the last one resumes where its only-child steps end.
        The steps before are the same while no key on them changed children.
        """
        walk, index = self._walk, self._walk_index
        children = self._children
        if walk and walk[0] == start:
            node = walk[-1]
            below = children.get(node)
        else:
            below = children.get(start)
            if below is None:
                # A leaf already: nothing worth remembering, and the last walk stays (it holds
                # while no key on it changes children, whatever was walked in between).
                return start
            walk[:] = (start,)
            index.clear()
            index[start] = 0
            node = start
        steps, limit = len(walk) - 1, len(self.t1) + len(self.t2)  # (no __len__ call)
        extending = True
        while below is not None:
            if steps >= limit:  # a cycle of recorded parents (colliding keys)
                walk.clear()
                index.clear()
                return None
            if type(below) is not _Siblings:  # an only child
                node = below
                if extending:
                    index[node] = len(walk)
                    walk.append(node)
            else:  # (the choice between siblings can change without a change of children)
                node = self._coldest(below)
                extending = False
            below = children.get(node)
            steps += 1
        return node

    def _children_changed(self, key: Hashable) -> None:
        """Cut the remembered walk after ``key``, whose children changed, if it is on it."""
        at = self._walk_index.get(key)
        if at is not None:
            walk, index = self._walk, self._walk_index
            for gone in walk[at + 1 :]:
                index.pop(gone, None)
            del walk[at + 1 :]

    def _choose_victim(self, p: float, in_b2: bool, can_evict: CanEvict | None) -> Hashable:
        """The victim, without moving anything. Raises when every resident key is vetoed.

        Orphans come first, then ARC's list order, each candidate walked down to a leaf.
        Only when pins hold every leaf does an inner key come next.
        """
        return self._careful_victim(self._replace_from_t1(p, in_b2), can_evict)

    def _careful_victim(self, from_t1: bool, can_evict: CanEvict | None) -> Hashable:
        """:meth:`_choose_victim` once ARC's list is chosen (``from_t1``: T1 first)."""
        order = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
        dead: set[Hashable] = set()
        first = True
        for entries in (self._orphans, *order):
            for candidate in entries:
                if first:  # the fast path's walk (remembered); only a veto or a loop goes on
                    first = False
                    leaf = self._walk_down(candidate)
                    if leaf is not None and (can_evict is None or can_evict(leaf)):
                        return leaf
                leaf = self._leaf_below(candidate, can_evict, dead)
                if leaf is not None:
                    return leaf
        for entries in order:
            found = first_evictable(entries, can_evict)
            if found is not None:
                return found
        raise NoEvictableEntry(f"all {len(self)} resident entries are pinned")

    def _replace_from_t1(self, p: float, in_b2: bool) -> bool:
        """ARC's choice of list (T1 above its target ``p``), unless T2's LRU chunk has expired."""
        t2 = self.t2
        n1 = len(self.t1)
        if not t2:
            return True
        if not n1:
            return False
        idle = self._clock - next(iter(t2.values()))  # T2's values are last uses
        if idle > self.idle_margin * self.reuse_horizon:
            return False
        return n1 > p or (in_b2 and n1 == p)

    def _leaf_below(
        self,
        key: Hashable,
        can_evict: CanEvict | None,
        dead: set[Hashable],
    ) -> Hashable | None:
        """The leaf reached from ``key``, if it may be evicted. See :meth:`_coldest`.

        ``dead`` collects the keys of failed walks.
        A walk that reaches one ends where that one did.
        So each REPLACE walks every key at most once.
        """
        children = self._children
        node = key
        path = [node]
        # Bounded walk: recorded parents could form a cycle only through colliding keys.
        for _ in range(len(self)):
            if node in dead:
                break
            below = children.get(node)
            if below is None:
                if can_evict is None or can_evict(node):
                    return node
                break
            node = self._coldest(below) if type(below) is _Siblings else below
            path.append(node)
        dead.update(path)
        return None

    def _coldest(self, siblings: _Siblings) -> Hashable:
        """The sibling to walk into: the oldest one seen only once, in T1, else the oldest."""
        # Ordering siblings by last use instead costs a timestamp per hit, and made no
        # measurable difference on the simulator's traces.
        t1 = self.t1
        if t1:  # (no lookups when T1 is empty)
            for key in siblings:
                if key in t1:
                    return key
        return next(iter(siblings))

    def _evict_key(self, victim: Hashable) -> None:
        """Move a resident victim to the ghost list of its list and to the long history."""
        t1 = self.t1
        if not t1 or t1.pop(victim, _ABSENT) is _ABSENT:  # (no call when T1 is empty)
            del self.t2[victim]
            self.b2[victim] = None
        else:
            self.b1[victim] = None
        self._remember_evicted(victim)
        if self._children:
            self._forget(victim)

    def _remember_evicted(self, victim: Hashable) -> None:
        """Add an evicted key to the long history, forgetting the oldest one beyond its limit."""
        limit = self._history_limit
        if limit:
            history = self.history
            history[victim] = None
            if len(history) > limit:
                history.popitem(last=False)

    def _forget(self, key: Hashable) -> None:
        """Drop a key that leaves from the chain bookkeeping (nothing to do without chains)."""
        orphans = self._orphans
        if orphans:
            orphans.pop(key, None)
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._unlink(key, parent)
        below = self._children.get(key)
        if below is not None:
            if type(below) is _Siblings:
                for child in below:
                    orphans[child] = None
            else:
                orphans[below] = None

    def _unlink(self, key: Hashable, parent: Hashable) -> None:
        children = self._children
        siblings = children[parent]
        if type(siblings) is _Siblings:
            del siblings[key]
            if not siblings:  # (only a lone None key stands in a _Siblings)
                del children[parent]
            elif len(siblings) == 1 and (only := next(iter(siblings))) is not None:
                children[parent] = only  # back to an only child
        else:  # key was the only child
            del children[parent]
        if parent in self._walk_index:
            self._children_changed(parent)


class _Siblings(dict[Hashable, None]):
    """Two or more children of one parent, or a lone ``None`` key, in the order linked.

    It has its own type so that it can be told from a key.
    A dict is never hashable, so no key is one.
    """

    __slots__ = ()


def _siblings(below: Any) -> tuple[Hashable, ...] | _Siblings:
    """The children an entry of ``_children`` stands for (``None``: no entry)."""
    if below is None:
        return ()
    return below if type(below) is _Siblings else (below,)


_ABSENT = object()
