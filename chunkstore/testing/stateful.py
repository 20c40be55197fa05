"""A Hypothesis state machine that drives any store against a plain dict model.

Usage in a test file::

    TestFsMachine = store_state_machine(lambda: FsStore(mkdtemp(), create=True)).TestCase

The factory is called once per generated run; the store is closed at teardown
(and ``cleanup``, if given, runs afterwards). Chunks come from one fixed chain,
so ``lookup_prefix`` is checked against the model's present prefix.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from chunkstore.backends.base import Store
from chunkstore.testing.factories import MadeChunk, sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

_CORRUPT = b"<corrupt>"
_CHAIN: list[MadeChunk] = sample_chunks(8, seed=5)
_DAMAGE = sorted(corrupt_copies(_CHAIN[0]))


def store_state_machine(
    factory: Callable[[], Store],
    cleanup: Callable[[Store], None] | None = None,
    *,
    max_examples: int = 25,
    steps: int = 25,
    copies: int = 1,
) -> type[RuleBasedStateMachine]:
    """A state machine class for ``factory``'s stores; use its ``.TestCase`` in a test module.

    ``copies``: how many copies of one chunk the store may hold (a tiered store: host
    memory and each tier); a read of a corrupt chunk finds and counts each damaged copy it
    meets, so the store's count of corrupt chunks lies between the corrupt reads and
    ``copies`` times them (times the keys' repeats within one batch).
    """

    index = st.integers(min_value=0, max_value=len(_CHAIN) - 1)

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.store = factory()
            self.model: dict[int, bytes] = {}
            self.corrupt_reads = 0
            """Corrupt chunks read (each batch asking for one counts it once)."""
            self.corrupt_most = 0
            """The most detections those reads may count."""

        @rule(i=index)
        def put(self, i: int) -> None:
            assert self.store.put(_CHAIN[i].key, _CHAIN[i].data) is True
            self.model[i] = _CHAIN[i].data

        @rule(i=index)
        def put_if_absent(self, i: int) -> None:
            wrote = self.store.put_if_absent(_CHAIN[i].key, _CHAIN[i].data)
            assert wrote == (i not in self.model)
            self.model.setdefault(i, _CHAIN[i].data)

        @rule(i=index, damage=st.sampled_from(_DAMAGE))
        def put_corrupt(self, i: int, damage: str) -> None:
            self.store.put(_CHAIN[i].key, corrupt_copies(_CHAIN[i])[damage])
            self.model[i] = _CORRUPT

        @rule(i=index)
        def delete(self, i: int) -> None:
            assert self.store.delete(_CHAIN[i].key) == (i in self.model)
            self.model.pop(i, None)

        @rule(picks=st.lists(index, min_size=1, max_size=4))
        def get_many(self, picks: list[int]) -> None:
            got = self.store.get_many([_CHAIN[i].key for i in picks])
            corrupt = {i for i in picks if self.model.get(i) is _CORRUPT}
            for i, data in zip(picks, got):
                expected = self.model.get(i)
                if expected is _CORRUPT:
                    assert data is None
                elif expected is None:
                    assert data is None
                else:
                    assert data is not None and bytes(data) == expected
            # A corrupt chunk is found at least once per batch that asks for it, and at most
            # once per time it is asked for and copy met (a batch may ask for a key twice).
            self.corrupt_reads += len(corrupt)
            self.corrupt_most += copies * sum(i in corrupt for i in picks)
            for i in corrupt:
                del self.model[i]  # quarantined: out of the serving path

        @rule(picks=st.lists(index, min_size=1, max_size=4))
        def exists_many(self, picks: list[int]) -> None:
            assert self.store.exists_many([_CHAIN[i].key for i in picks]) == [
                i in self.model for i in picks
            ]

        @rule(n=st.integers(min_value=1, max_value=len(_CHAIN)))
        def lookup_prefix(self, n: int) -> None:
            keys = [c.key for c in _CHAIN[:n]]
            expected = next((i for i in range(n) if i not in self.model), n)
            got = self.store.lookup_prefix(keys)
            if self.store.high_latency:
                # binary search assumes a monotone chain; it must still land on a boundary
                assert got == n or got == 0 or (got - 1 in self.model and got not in self.model)
                if expected == n:
                    assert got == n
            else:
                assert got == expected

        @precondition(lambda self: self.store.supports_listing)
        @rule()
        def listing(self) -> None:
            infos = {info.key: info for info in self.store.list()}
            assert set(infos) == {_CHAIN[i].key for i in self.model}
            for i, data in self.model.items():
                if data is not _CORRUPT:
                    assert infos[_CHAIN[i].key].size == len(data)

        @invariant()
        def corrupt_count(self) -> None:
            assert self.corrupt_reads <= self.store.corrupt_detected <= self.corrupt_most

        def teardown(self) -> None:
            try:
                self.store.close()
            finally:
                if cleanup is not None:
                    cleanup(self.store)

    StoreMachine.TestCase.settings = settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None
    )
    return StoreMachine
