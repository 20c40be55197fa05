"""WrapperStore forwards everything: a wrapped store still passes the conformance suite."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from chunkstore.backends import base
from chunkstore.backends._fs import FsStore
from chunkstore.backends._memory import MemoryStore
from chunkstore.backends._wrapper import WrapperStore
from chunkstore.backends.base import Store
from chunkstore.errors import ChecksumMismatch
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import StoreSuite, corrupt_copies


class TestWrapperStore(StoreSuite):
    persistent = False

    @pytest.fixture
    def make_store(self) -> Callable[[], Store]:
        return lambda: WrapperStore(MemoryStore(name="inner"))


def test_name_kind_and_capabilities_are_the_inner_stores() -> None:
    inner = MemoryStore(name="inner")
    store = WrapperStore(inner)
    assert (store.name, store.kind) == ("inner", "memory")
    assert store.supports_listing and store.atomic_put and not store.high_latency
    chunk = sample_chunks(1)[0]
    store.put(chunk.key, chunk.data)
    assert inner.get(chunk.key) == chunk.data
    store.close()
    assert inner.get(chunk.key) is None  # closing the wrapper closed the memory store


def test_damage_reported_through_a_wrapper_is_the_inner_store_s(tmp_path: Path) -> None:
    """A caller that checks what it read (the vLLM tier) reports damage to the store it
    holds, a wrapper (ZstdStore): the inner store counts it (its count is the one shown)
    and sets the chunk aside its own way (quarantine), not by a plain delete."""
    chunk = sample_chunks(1, seed=89)[0]
    inner = FsStore(str(tmp_path / "s"), create=True)
    store = WrapperStore(inner)
    store.put(chunk.key, corrupt_copies(chunk)["bitflip"])
    store.report_corrupt(chunk.key, ChecksumMismatch("found by the caller"))
    assert store.corrupt_detected == 1
    assert [Path(q.path).name for q in inner.quarantined()] == [f"{chunk.key.hex}.kvc"]
    store.close()


def test_a_wrapper_verifies_as_its_inner_store_does_and_checks_nothing_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller deciding whether to checksum what a store served (the vLLM native tier)
    reads ``verify``: a wrapper's is the inner store's, which checks every chunk read
    through it; the wrapper does not judge the chunk a second time."""
    inner = MemoryStore()
    store = WrapperStore(inner)
    assert store.verify is True
    store.verify = False
    assert inner.verify is False and WrapperStore(inner).verify is False
    store.verify = True
    chunk = sample_chunks(1, seed=97)[0]
    store.put(chunk.key, chunk.data)
    judged: list[bytes] = []
    real = base.judge
    monkeypatch.setattr(
        base, "judge", lambda key, data: judged.append(key.digest) or real(key, data)
    )
    assert store.get(chunk.key) == chunk.data
    assert judged == [chunk.key.digest]
