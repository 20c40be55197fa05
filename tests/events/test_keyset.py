"""KeySet: a set of chunk keys, checked against Python's own set, that no collection walks."""

from __future__ import annotations

import gc
import platform

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkstore.events._keyset import KeySet
from chunkstore.hashing import ChunkKey

# Few digests and namespaces, so that adds, discards and lookups meet each other often.
keys = st.builds(
    ChunkKey,
    st.sampled_from([bytes([n]) * 32 for n in range(6)]),
    st.sampled_from(["0" * 16, "a" * 16, "0123456789abcdef"]),
)
ops = st.lists(st.tuples(st.sampled_from(["add", "discard", "update"]), st.lists(keys)))


@settings(max_examples=300, deadline=None)
@given(ops, st.lists(keys), st.lists(keys))
def test_keyset_behaves_as_a_set_of_keys(steps, other, third):
    mine, model = KeySet(), set()
    for op, batch in steps:
        if op == "add":
            for key in batch:
                mine.add(key)
                model.add(key)
        elif op == "discard":
            for key in batch:
                mine.discard(key)
                model.discard(key)
        else:
            mine.update(batch)
            model.update(batch)
        assert len(mine) == len(model)
        assert set(mine) == model
        assert all(key in mine for key in model)
    assert sorted(mine.minus(KeySet(other), KeySet(third))) == sorted(
        model - set(other) - set(third)
    )
    assert sorted(mine.minus()) == sorted(model)
    assert "not a key" not in mine
    mine.clear()
    assert len(mine) == 0 and list(mine) == []


def test_a_key_in_another_namespace_is_another_key():
    held = KeySet([ChunkKey(b"\x01" * 32, "0" * 16)])
    assert ChunkKey(b"\x01" * 32, "a" * 16) not in held
    held.discard(ChunkKey(b"\x01" * 32, "a" * 16))
    assert len(held) == 1


@pytest.mark.skipif(
    platform.python_implementation() != "CPython",
    reason="untracked dicts of atomic objects are CPython's",
)
def test_the_collector_does_not_track_the_digests():
    held = KeySet(ChunkKey(n.to_bytes(32, "big"), "0" * 16) for n in range(1000))
    inner = list(held._by_namespace.values())
    assert inner and not any(gc.is_tracked(digests) for digests in inner)
    gc.collect()  # a full collection must not start tracking them either
    assert not any(gc.is_tracked(digests) for digests in inner)
