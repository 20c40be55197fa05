"""The names a reconcile walked, kept as 64-bit hashes: membership as a set would answer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from chunkstore.backends._index import WalkedNames, _pages

NAMES = st.text(alphabet="0123456789abcdef/", min_size=1, max_size=80)


@given(walked=st.sets(NAMES, max_size=300), asked=st.lists(NAMES, max_size=300))
def test_membership_matches_a_set_of_the_names(walked: set[str], asked: list[str]) -> None:
    found = WalkedNames()
    for name in walked:
        found.add(name)
    found.freeze()
    # Distinct short strings sharing a 64-bit hash: about 1 in 10^14 here, so exact.
    assert found.contains_many(asked) == [name in walked for name in asked]
    assert found.contains_many(sorted(walked)) == [True] * len(walked)


def test_nothing_walked_contains_nothing() -> None:
    found = WalkedNames()
    found.freeze()
    assert found.contains_many(["ns/ab/00", "ns/cd/01"]) == [False, False]
    assert found.contains_many([]) == []


def test_pages_cut_a_stream_into_lists_of_the_size() -> None:
    pages = list(_pages(iter(str(i) for i in range(7)), 3))
    assert pages == [["0", "1", "2"], ["3", "4", "5"], ["6"]]
    assert list(_pages(iter([]), 3)) == []
