"""Prefix-aware ARC (parc): eviction sequences traced by hand, and its invariants under Hypothesis.

Lists are written LRU first. The rules (chunkstore/cache/_prefix_arc.py): REPLACE
picks T1 or T2 as ARC does; the victim is the leaf reached from that list's LRU
(among siblings the walk prefers one in T1); orphans (parent gone) go before
anything; the parent of the key being admitted goes only when nothing else can.
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from chunkstore.cache import NoEvictableEntry, PrefixARCPolicy
from chunkstore.errors import ConfigError
from tests.cache.policy_suite import KEYS, ARCPinMachine


def chain(policy: PrefixARCPolicy, keys: list[Hashable]) -> list[tuple[bool, Hashable | None]]:
    """Read ``keys`` as one request (each key's parent is the one before): (hit, victim) each."""
    out: list[tuple[bool, Hashable | None]] = []
    parent = None
    for key in keys:
        if policy.hit(key):
            out.append((True, None))
        else:
            out.append((False, policy.admit(key, parent=parent)))
        parent = key
    return out


def test_evicts_a_chains_tail_not_its_head() -> None:
    # c = 4. Chains a0-a1 and b0-b1 fill T1 = [a0 a1 b0 b1].
    policy = PrefixARCPolicy(4)
    chain(policy, ["a0", "a1"])
    chain(policy, ["b0", "b1"])
    # c0: ARC's REPLACE picks T1's LRU a0, which still has a child: walk down to a1.
    # c1 (parent c0): T1 = [a0 b0 b1 c0]; a0 is a leaf now, and goes.
    assert chain(policy, ["c0", "c1"]) == [(False, "a1"), (False, "a0")]
    assert list(policy.t1) == ["b0", "b1", "c0", "c1"]
    # ARC's bound |T1| + |B1| <= c leaves no room for ghosts; the long history keeps both.
    assert list(policy.b1) == [] and list(policy.history) == ["a1", "a0"]
    # ARC itself would have evicted a0 then a1 as well, but in the other order: a1 would have
    # been a useless resident for one step. Next, d0 walks from b0 to b1.
    assert chain(policy, ["d0"]) == [(False, "b1")]


def test_shared_prefix_outlives_its_conversations() -> None:
    # c = 3. s is every request's first chunk: its second read moves it to T2.
    policy = PrefixARCPolicy(3)
    chain(policy, ["s", "x"])
    assert chain(policy, ["s", "y"]) == [(True, None), (False, None)]
    assert (list(policy.t1), list(policy.t2)) == (["x", "y"], ["s"])
    assert policy.children_of("s") == {"x", "y"}
    # A new chain z0-z1: |T1| = 2 > p = 0, so T1's LRU x goes, then y; s stays.
    assert chain(policy, ["z0", "z1"]) == [(False, "x"), (False, "y")]
    assert set(policy) == {"s", "z0", "z1"}


def test_walks_into_a_child_seen_only_once() -> None:
    # c = 4: r with children a and b, then x; T1 = [r a b x].
    policy = PrefixARCPolicy(4)
    policy.admit("r")
    policy.admit("a", parent="r")
    policy.admit("b", parent="r")
    policy.admit("x")
    assert policy.hit("a")  # a -> T2: read twice
    # z: |T1| = 3 > p = 0, so REPLACE starts at T1's LRU r; of its children b is the one
    # seen only once (in T1), and a leaf.
    assert policy.admit("z") == "b"
    # w: the walk from r now reaches a, although a sits in T2 (its ghost goes to B2).
    assert policy.admit("w") == "a"
    assert list(policy.b2) == ["a"] and set(policy) == {"r", "x", "z", "w"}


def test_a_remembered_walk_turns_into_a_new_sibling() -> None:
    # c = 6: the chain s-x-y-w with y read twice (T2), and roots a, b; T1 = [s x w a b].
    policy = PrefixARCPolicy(6)
    for key, parent in (("s", None), ("x", "s"), ("y", "x"), ("w", "y")):
        policy.access(key, parent)
    assert policy.hit("y")
    policy.admit("a")
    policy.admit("b")
    assert policy.admit("c") == "w"  # walked s-x-y-w from T1's LRU s
    policy.remove("c")  # room for z without an eviction
    policy.admit("z", parent="x")  # x has two children now: y (T2) and z (T1)
    # The next walk starts at s again but must not resume at y: z is the child seen once.
    assert policy.admit("d") == "z"


def test_siblings_keep_their_link_order_through_an_only_child() -> None:
    # An only child is stored apart from a list of siblings; going from two children to one
    # and back must keep the order they were linked in, which the walk's choice reads.
    policy = PrefixARCPolicy(4)
    policy.admit("r")
    policy.admit("a", parent="r")
    policy.admit("b", parent="r")
    assert policy.remove("a")  # r's only child: b
    assert policy.children_of("r") == {"b"}
    policy.admit("c", parent="r")  # r: b, then c; T1 = [r b c], all seen once
    assert policy.children_of("r") == {"b", "c"}
    assert policy.evict() == "b"  # from T1's LRU r into its oldest child seen once
    assert policy.children_of("r") == {"c"}
    assert policy.evict() == "c"  # r's only child again
    assert policy.children_of("r") == frozenset() and policy.evict() == "r"


def test_a_chain_longer_than_the_cache_keeps_its_head() -> None:
    # c = 3, one chain 0..5. Admitting 3 (parent 2): the walk from the LRU entry 0 ends at
    # the leaf 2, which goes, and 3 is an orphan. Orphans go first: 3 makes room for 4, 4 for
    # 5. The head 0-1 stays usable.
    policy = PrefixARCPolicy(3)
    assert chain(policy, list(range(6))) == [
        (False, None),
        (False, None),
        (False, None),
        (False, 2),
        (False, 3),
        (False, 4),
    ]
    assert list(policy.t1) == [0, 1, 5]
    # Read again: 0 and 1 hit; 2 evicts the orphan 5, and the chain grows back from its head.
    assert chain(policy, list(range(3))) == [(True, None), (True, None), (False, 5)]
    assert set(policy) == {0, 1, 2}


def test_an_old_growing_chain_eats_its_own_tail() -> None:
    # c = 4: b0 is the oldest entry, x and y came later, then b1 (parent b0).
    policy = PrefixARCPolicy(4)
    for key in ["b0", "x", "y"]:
        policy.admit(key)
    policy.admit("b1", parent="b0")
    # b2 (parent b1): the walk from T1's LRU b0 ends at b1, the parent of b2. It goes, not x
    # or y: a chain read once must not push out the rest of the cache as it grows.
    assert policy.admit("b2", parent="b1") == "b1"
    assert policy.parent_of("b2") == "b1" and "b1" not in policy
    assert policy.admit("z") == "b2"  # b2 is an orphan now: the next to go
    assert set(policy) == {"b0", "x", "y", "z"}


def test_orphans_go_before_the_lru_entry() -> None:
    policy = PrefixARCPolicy(3)
    policy.admit("x")
    policy.admit("p")
    policy.admit("c", parent="p")
    assert policy.remove("p")  # deleted: c is an orphan now, worthless until p returns
    assert policy.admit("y") is None  # the deletion left room
    assert policy.admit("z") == "c"  # not x, the LRU entry
    # p comes back as a brand-new key; a child admitted under it is no orphan.
    assert policy.admit("p") == "x"
    assert policy.admit("c", parent="p") == "y"
    assert policy.parent_of("c") == "p" and policy.children_of("p") == {"c"}


def test_link_after_admission_steers_eviction() -> None:
    # The host cache learns a chunk's parent from its header once the chunk is written.
    policy = PrefixARCPolicy(3)
    for key in "abc":
        policy.admit(key)
    policy.link("b", "a")
    policy.link("b", "b")  # a key is never its own parent: ignored
    policy.link("zz", "a")  # not resident: ignored
    assert policy.parent_of("b") == "a" and policy.parent_of("zz") is None
    assert policy.admit("d") == "b"  # the walk from a ends at its child b


def test_pinned_leaf_sends_replace_to_the_next_candidate() -> None:
    policy = PrefixARCPolicy(3)
    chain(policy, ["a0", "a1"])
    chain(policy, ["b0"])
    # a0's walk ends at a1, which is pinned: b0 is the victim, and nothing pinned moves.
    assert policy.admit("z", lambda k: k != "a1") == "b0"
    assert list(policy.t1) == ["a0", "a1", "z"]


def test_when_every_leaf_is_pinned_an_inner_key_goes() -> None:
    policy = PrefixARCPolicy(2)
    chain(policy, ["a0", "a1"])
    assert policy.admit("z", lambda k: k != "a1") == "a0"
    assert policy.parent_of("a1") == "a0" and set(policy) == {"a1", "z"}
    with pytest.raises(NoEvictableEntry):
        policy.admit("w", lambda k: False)
    assert set(policy) == {"a1", "z"}


def test_long_history_admits_a_returning_key_to_t2() -> None:
    # c = 1: ARC's ghost of a is trimmed at once (|T1| + |B1| <= c), the long history keeps it.
    policy = PrefixARCPolicy(1, history=4)
    policy.admit("a")
    assert policy.admit("b") == "a"
    assert list(policy.b1) == [] and list(policy.history) == ["a"]
    assert policy.admit("a") == "b"
    assert list(policy.t2) == ["a"] and list(policy.t1) == []
    assert list(policy.history) == ["b"]
    # Without history, the returning key is new again.
    plain = PrefixARCPolicy(1, history=0)
    plain.admit("a")
    plain.admit("b")
    plain.admit("a")
    assert list(plain.t1) == ["a"] and list(plain.history) == []


def test_a_b2_ghost_hit_turns_to_frequency_faster() -> None:
    # c = 4, no history. a b read twice (T2), c d once (T1); e evicts c (T1's LRU) to B1;
    # c again is a B1 hit: p = 0 + 1, and REPLACE (|T1| = 2 > p) evicts d to B1.
    # f: |T1| = 1 is not > p = 1, so T2's LRU a goes to B2.
    policy = PrefixARCPolicy(4, history=0, frequency_step=2.0)
    for key in "abab":
        policy.access(key)
    assert [policy.admit(k) for k in "cdecf"] == [None, None, "c", "d", "a"]
    assert (list(policy.t1), list(policy.t2), list(policy.b2), policy.p) == (
        ["e", "f"],
        ["b", "c"],
        ["a"],
        1.0,
    )
    policy.p = 3.0  # as if recency had been winning for a while
    # a returns from B2: ARC would shrink p by one step (|B1| = |B2| = 1) to 2.0; parc by two.
    assert policy.admit("a") == "e"
    assert policy.p == 1.0 and list(policy.t2) == ["b", "c", "a"]
    with pytest.raises(ConfigError, match="frequency_step"):
        PrefixARCPolicy(4, frequency_step=0.5)


def test_history_is_bounded() -> None:
    policy = PrefixARCPolicy(2, history=2)
    for key in range(20):
        policy.access(key)
    assert list(policy.history) == [14, 15, 16, 17]


def test_bad_history() -> None:
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="history"):
            PrefixARCPolicy(2, history=bad)  # type: ignore[arg-type]


def test_an_idle_frequent_chunk_expires_before_recent_ones() -> None:
    # c = 4, floor 1 (the horizon starts at 4 lookups), margin 1. a is read twice (T2, last used
    # at lookup 1); x1 x2 x3 fill T1. p = 0, so ARC takes T1's LRU on every new key.
    policy = PrefixARCPolicy(4, history=0, idle_margin=1.0, idle_floor=1)
    plain = PrefixARCPolicy(4, history=0, idle_margin=float("inf"))
    for each in (policy, plain):
        for key in ["a", "a", "x1", "x2", "x3"]:
            each.access(key)
        assert list(each.t2) == ["a"] and each.p == 0.0
    assert policy.admit("y") == "x1"  # lookup 5: a idle 4 lookups, not more than 1 x 4
    assert policy.admit("z") == "a"  # lookup 6: idle 5 > 4, expired although p favours T2
    assert [plain.admit(k) for k in "yz"] == ["x1", "x2"]  # ARC's choice alone keeps a


def test_the_horizon_follows_the_idle_times_of_t2_rereads() -> None:
    # Floor 0: the horizon starts at 1 lookup. a a: T1 -> T2 (no idle time measured).
    policy = PrefixARCPolicy(2, history=0, idle_floor=0)
    policy.access("a")
    policy.access("a")
    assert policy.reuse_horizon == 1.0
    for key in range(3):
        policy.access(key)
        policy.remove(key)
    assert policy.hit("a")  # idle 4 lookups > 1: the estimate goes up by 5 %
    assert policy.reuse_horizon == pytest.approx(1.05)
    assert policy.hit("a")  # idle 0: down by 5 % x 1/99 (a 99th-percentile estimate)
    assert policy.reuse_horizon == pytest.approx(1.05 * (1 - 0.05 / 99))
    # Never below the floor (here 3 lookups per entry).
    floored = PrefixARCPolicy(2, history=0, idle_floor=3)
    for _ in range(4):
        floored.access("a")
    assert floored.reuse_horizon == 6.0


def test_bad_idle_settings() -> None:
    for bad in (0.5, True, "2"):
        with pytest.raises(ConfigError, match="idle_margin"):
            PrefixARCPolicy(2, idle_margin=bad)  # type: ignore[arg-type]
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="idle_floor"):
            PrefixARCPolicy(2, idle_floor=bad)  # type: ignore[arg-type]


class PrefixARCMachine(ARCPinMachine):
    """parc under the ARC pin machine, plus chained requests, late links and lone evictions."""

    def make(self) -> PrefixARCPolicy:
        return PrefixARCPolicy(4, history=2)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=6))
    def request(self, keys: list[int]) -> None:
        parent: int | None = None
        for key in keys:
            if not self.read(key, parent):
                return
            parent = key

    @precondition(lambda self: self.resident)
    @rule(data=st.data(), parent=KEYS)
    def link(self, data: st.DataObject, parent: int) -> None:
        key = data.draw(st.sampled_from(sorted(self.resident)))  # type: ignore[type-var]
        self.policy.link(key, parent)

    @rule()
    def evict(self) -> None:
        victim = self.policy.evict(lambda k: k not in self.pinned)
        if victim is None:
            assert self.resident <= self.pinned
        else:
            assert victim in self.resident and victim not in self.pinned
            self.resident.discard(victim)

    @invariant()
    def chain_bookkeeping(self) -> None:
        policy = self.policy
        assert isinstance(policy, PrefixARCPolicy)
        assert len(policy.history) <= 8 and not set(policy.history) & self.resident
        for key in self.resident:
            parent = policy.parent_of(key)
            if parent is not None:
                assert key in policy.children_of(parent)
        for key in range(12):
            assert policy.children_of(key) <= self.resident
        # Every T2 key carries its last use, a past lookup (idle expiry reads it).
        assert all(0 <= last < policy._clock for last in policy.t2.values())
        assert policy.reuse_horizon >= policy._horizon_floor


TestPrefixARCMachine = PrefixARCMachine.TestCase
TestPrefixARCMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


class PrefixARCExpiryMachine(PrefixARCMachine):
    """The same rules with expiry on a hair trigger (margin 1, no floor): it fires constantly."""

    def make(self) -> PrefixARCPolicy:
        return PrefixARCPolicy(4, history=2, idle_margin=1.0, idle_floor=0)


TestPrefixARCExpiryMachine = PrefixARCExpiryMachine.TestCase
TestPrefixARCExpiryMachine.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None
)


def _state(policy: PrefixARCPolicy) -> tuple[object, ...]:
    """Everything a later decision of ``policy`` can depend on, in the policy's own orders."""
    chains = {key: (policy.parent_of(key), policy.children_of(key)) for key in range(20)}
    return (
        list(policy.t1.items()),
        list(policy.t2.items()),
        list(policy.b1),
        list(policy.b2),
        list(policy.history),
        list(policy._orphans),
        policy.p,
        policy._clock,
        policy._horizon,
        policy._rereads_within,
        chains,
    )


WIDE_KEYS = st.integers(min_value=0, max_value=19)
"""Five times the capacity below: ghost hits in both lists, long-history returns, orphans."""
LOOKUPS = st.lists(
    st.tuples(
        st.sampled_from(["read"] * 6 + ["link", "evict", "remove"]),
        WIDE_KEYS,
        st.one_of(st.none(), WIDE_KEYS),
    ),
    max_size=200,
)


@pytest.mark.parametrize("history, margin, floor", [(2, 2.5, 2), (2, 1.0, 0), (0, 2.5, 2)])
@settings(max_examples=150, deadline=None)
@given(steps=LOOKUPS)
def test_unpinned_admissions_decide_as_the_careful_path(
    history: int, margin: float, floor: int, steps: list[tuple[str, int, int | None]]
) -> None:
    # access() and admit() without can_evict take the inlined fast path (_admit_unpinned);
    # a can_evict that accepts everything takes the careful one. They must not differ.
    fast = PrefixARCPolicy(4, history=history, idle_margin=margin, idle_floor=floor)
    careful = PrefixARCPolicy(4, history=history, idle_margin=margin, idle_floor=floor)
    for action, key, parent in steps:
        if action == "read":
            hit = careful.hit(key)
            victim = None if hit else careful.admit(key, lambda _: True, parent=parent)
            if parent is None:  # both entry points of the fast path
                assert fast.access(key, parent) == hit
            elif not fast.hit(key):
                assert fast.admit(key, parent=parent) == victim
        elif action == "link" and parent is not None:
            fast.link(key, parent)
            careful.link(key, parent)
        elif action == "evict":
            assert fast.evict() == careful.evict()
        elif action == "remove":
            assert fast.remove(key) == careful.remove(key)
        assert _state(fast) == _state(careful)
