"""Every host policy passes the shared policy contract; ARC and LRU agree with reference models."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from chunkstore.cache import (
    POLICY_NAMES,
    ARCPolicy,
    LRUPolicy,
    NoEvictableEntry,
    PrefixARCPolicy,
    make_policy,
)
from chunkstore.errors import ConfigError
from tests.cache.policy_suite import KEYS, ARCPinMachine, PolicyTestMixin
from tests.cache.reference_arc import PaperARC


class TestARC(PolicyTestMixin):
    policy_class = ARCPolicy


class TestLRU(PolicyTestMixin):
    policy_class = LRUPolicy


class TestPrefixARC(PolicyTestMixin):
    policy_class = PrefixARCPolicy


def test_arc_evict_leaves_a_ghost_that_steers_p() -> None:
    policy = ARCPolicy(3)
    for key in "abc":
        policy.admit(key)
    assert policy.evict() == "a"
    assert list(policy.b1) == ["a"] and policy.p == 0.0
    # "a" comes back: a B1 ghost hit (Case II) grows p and lands in T2, as after a REPLACE.
    assert policy.admit("a") is None
    assert "a" in policy.t2 and policy.p == 1.0


def test_make_policy() -> None:
    assert isinstance(make_policy("parc", 2), PrefixARCPolicy)
    assert isinstance(make_policy("arc", 2), ARCPolicy)
    assert isinstance(make_policy("LRU", 2), LRUPolicy)
    with pytest.raises(ConfigError, match="parc, arc, lru"):
        make_policy("fifo", 2)


def test_the_shared_suite_covers_every_policy() -> None:
    tested = {cls.policy_class.name for cls in (TestARC, TestLRU, TestPrefixARC)}
    assert tested == set(POLICY_NAMES)
    assert all(make_policy(name, 2).name == name for name in POLICY_NAMES)


class LRUMachine(RuleBasedStateMachine):
    """LRUPolicy against a plain list (oldest first), with pins and removals."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = LRUPolicy(4)
        self.model: list[int] = []
        self.pinned: set[int] = set()

    @rule(key=KEYS)
    def access(self, key: int) -> None:
        hit = key in self.model
        assert self.policy.hit(key) is hit
        if hit:
            self.model.remove(key)
            self.model.append(key)
            return
        candidates = [k for k in self.model if k not in self.pinned]
        if len(self.model) >= 4 and not candidates:
            with pytest.raises(NoEvictableEntry):
                self.policy.admit(key, lambda k: k not in self.pinned)
            return
        victim = self.policy.admit(key, lambda k: k not in self.pinned)
        if len(self.model) >= 4:
            assert victim == candidates[0]
            self.model.remove(victim)
        else:
            assert victim is None
        self.model.append(key)

    @rule(key=KEYS)
    def toggle_pin(self, key: int) -> None:
        self.pinned ^= {key}

    @rule(key=KEYS)
    def remove(self, key: int) -> None:
        assert self.policy.remove(key) is (key in self.model)
        if key in self.model:
            self.model.remove(key)

    @invariant()
    def same_order(self) -> None:
        assert list(self.policy) == self.model


class ARCMachine(RuleBasedStateMachine):
    """ARCPolicy against a literal transcription of the paper's Fig. 4 (request stream only)."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = ARCPolicy(4)
        self.paper = PaperARC(4)

    @rule(key=KEYS)
    def request(self, key: int) -> None:
        assert self.policy.access(key) is self.paper.request(key)

    @invariant()
    def same_lists(self) -> None:
        assert list(self.policy.t1) == self.paper.t1
        assert list(self.policy.t2) == self.paper.t2
        assert list(self.policy.b1) == self.paper.b1
        assert list(self.policy.b2) == self.paper.b2
        assert self.policy.p == self.paper.p


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLRUMachine = LRUMachine.TestCase
TestLRUMachine.settings = _SETTINGS
TestARCMachine = ARCMachine.TestCase
TestARCMachine.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestARCPinMachine = ARCPinMachine.TestCase
TestARCPinMachine.settings = _SETTINGS
