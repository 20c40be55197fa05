"""One contract every replacement policy passes (cachetools ``CacheTestMixin`` style).

A policy's test class only says how to make one::

    class TestLRU(PolicyTestMixin):
        policy_class = LRUPolicy
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from chunkstore.cache._arc import ARCPolicy
from chunkstore.cache.policy import CachePolicy, NoEvictableEntry
from chunkstore.errors import ConfigError

KEYS = st.integers(min_value=0, max_value=11)


class PolicyTestMixin:
    """Behaviour shared by every policy (parc, ARC, LRU)."""

    policy_class: type[CachePolicy]

    def make(self, capacity: int) -> CachePolicy:
        return self.policy_class(capacity)

    def test_rejects_bad_capacity(self) -> None:
        for bad in (0, -1, 1.5, True, "3"):
            with pytest.raises(ConfigError):
                self.policy_class(bad)  # type: ignore[arg-type]

    def test_empty(self) -> None:
        policy = self.make(3)
        assert len(policy) == 0
        assert 1 not in policy
        assert list(policy) == []
        assert policy.hit(1) is False
        assert len(policy) == 0  # a miss changes nothing
        assert policy.remove(1) is False

    def test_admit_then_hit(self) -> None:
        policy = self.make(3)
        assert policy.admit("a") is None
        assert "a" in policy and len(policy) == 1
        assert policy.hit("a") is True
        assert set(policy) == {"a"}

    def test_fills_without_evicting(self) -> None:
        policy = self.make(4)
        assert [policy.admit(k) for k in range(4)] == [None] * 4
        assert set(policy) == {0, 1, 2, 3}

    def test_never_exceeds_capacity(self) -> None:
        policy = self.make(3)
        evicted = []
        for key in range(10):
            victim = policy.admit(key)
            if victim is not None:
                evicted.append(victim)
            assert len(policy) <= 3
        assert len(evicted) == 7
        assert set(policy) | set(evicted) == set(range(10))
        assert not set(policy) & set(evicted)

    def test_evicted_key_is_gone(self) -> None:
        policy = self.make(2)
        policy.admit("a")
        policy.admit("b")
        victim = policy.admit("c")
        assert victim in ("a", "b")
        assert victim not in policy
        assert policy.hit(victim) is False

    def test_scan_of_new_keys_evicts_oldest_first(self) -> None:
        # With no re-references (and no chains) every policy evicts in insertion order.
        policy = self.make(3)
        victims = [policy.admit(k) for k in range(8)]
        assert victims == [None, None, None, 0, 1, 2, 3, 4]

    def test_recently_hit_key_survives_one_new_key(self) -> None:
        policy = self.make(3)
        for key in "abc":
            policy.admit(key)
        policy.hit("a")
        assert policy.admit("d") == "b"
        assert "a" in policy

    def test_remove(self) -> None:
        policy = self.make(2)
        policy.admit("a")
        policy.admit("b")
        assert policy.remove("a") is True
        assert "a" not in policy and len(policy) == 1
        assert policy.admit("c") is None  # the room freed by remove is used first
        assert set(policy) == {"b", "c"}

    def test_can_evict_skips_vetoed_keys(self) -> None:
        policy = self.make(3)
        for key in "abc":
            policy.admit(key)
        pinned = {"a"}
        victim = policy.admit("d", lambda k: k not in pinned)
        assert victim == "b"
        assert "a" in policy and "d" in policy

    def test_all_pinned_raises_and_changes_nothing(self) -> None:
        policy = self.make(2)
        policy.admit("a")
        policy.admit("b")
        before = sorted(policy)  # type: ignore[type-var]
        with pytest.raises(NoEvictableEntry):
            policy.admit("c", lambda k: False)
        assert sorted(policy) == before  # type: ignore[type-var]
        assert "c" not in policy
        assert policy.admit("c") in ("a", "b")  # still usable afterwards

    def test_evict_makes_room_ahead_of_admission(self) -> None:
        policy = self.make(3)
        assert policy.evict() is None
        for key in "abc":
            policy.admit(key)
        assert policy.evict() == "a"
        assert "a" not in policy and len(policy) == 2
        assert policy.admit("d") is None  # the room was already made
        assert policy.evict(lambda k: k != "b") == "c"
        assert policy.evict(lambda k: False) is None
        assert sorted(policy) == ["b", "d"]  # type: ignore[type-var]

    def test_access_counts_hits(self) -> None:
        policy = self.make(2)
        stream: list[Hashable] = ["a", "a", "b", "a", "c", "a", "b"]
        hits = [policy.access(k) for k in stream]
        assert hits[:4] == [False, True, False, True]
        assert hits[5] is True  # "a" was hit twice: it outlives "b"
        assert len(policy) == 2

    def test_access_matches_hit_then_admit(self) -> None:
        stream = [k % 7 for k in range(0, 200, 3)] + [1, 2, 3, 1, 2, 3, 9, 9]
        one, two = self.make(4), self.make(4)
        for key in stream:
            expected = two.hit(key)
            if not expected:
                two.admit(key)
            assert one.access(key) is expected
        assert sorted(one) == sorted(two)  # type: ignore[type-var]

    def test_capacity_one(self) -> None:
        policy = self.make(1)
        assert policy.access(1) is False
        assert policy.access(1) is True
        assert policy.access(2) is False
        assert list(policy) == [2]

    def test_repr_names_class(self) -> None:
        assert self.policy_class.__name__ in repr(self.make(2))


class ARCPinMachine(RuleBasedStateMachine):
    """An ARC-family policy (``make``) with pins and removals: its bookkeeping stays consistent.

    Capacity 4 over keys 0..11; subclasses add rules (parc adds chains and links).
    """

    def make(self) -> ARCPolicy:
        return ARCPolicy(4)

    def __init__(self) -> None:
        super().__init__()
        self.policy = self.make()
        self.resident: set[Hashable] = set()
        self.pinned: set[int] = set()

    @rule(key=KEYS)
    def access(self, key: int) -> None:
        self.read(key, None)

    def read(self, key: int, parent: int | None) -> bool:
        """One lookup that admits on a miss, checked against the model; False if all pinned."""
        if self.policy.hit(key):
            assert key in self.resident
            return True
        assert key not in self.resident
        try:
            victim = self.policy.admit(key, lambda k: k not in self.pinned, parent=parent)
        except NoEvictableEntry:
            assert len(self.resident) >= 4 and self.resident <= self.pinned
            return False
        if victim is not None:
            assert victim in self.resident and victim not in self.pinned
            self.resident.discard(victim)
        self.resident.add(key)
        return True

    @rule(key=KEYS)
    def toggle_pin(self, key: int) -> None:
        self.pinned ^= {key}

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        assert self.policy.remove(key) is (key in self.resident)
        self.resident.discard(key)

    @invariant()
    def bounds(self) -> None:
        policy = self.policy
        assert set(policy) == self.resident
        assert len(policy) <= 4
        assert len(policy.t1) + len(policy.b1) <= 4
        assert len(policy.t1) + len(policy.t2) + len(policy.b1) + len(policy.b2) <= 8
        assert 0 <= policy.p <= 4
        lists = [set(policy.t1), set(policy.t2), set(policy.b1), set(policy.b2)]
        assert sum(len(s) for s in lists) == len(set().union(*lists))  # disjoint
