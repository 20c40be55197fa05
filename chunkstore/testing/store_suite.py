"""The conformance suite every store passes (pytest mixin).

A backend's test file only says how to make one::

    class TestMyStore(StoreSuite):
        @pytest.fixture
        def make_store(self, tmp_path):
            return lambda: MyStore(tmp_path / "s")

``make_store`` is a fixture returning a zero-argument factory; each call opens
a *new* store object over the same location (so the suite can check that a
fresh process sees what an earlier one wrote). Set ``persistent = False`` for
stores that live only in their object (the memory store).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from chunkstore.backends.base import (
    Store,
    SupportsGetInto,
    SupportsGetManyInto,
    SupportsRangedRead,
)
from chunkstore.errors import ChunkStoreError, ConfigError
from chunkstore.format import ChunkLayout, decode_chunk, encode_chunk
from chunkstore.testing.factories import MadeChunk, kv_tensors, sample_chunks, small_spec


def corrupt_copies(chunk: MadeChunk) -> dict[str, bytes]:
    """Damaged versions of a chunk: each one must read as a miss."""
    data = bytearray(chunk.data)
    flipped = bytearray(data)
    flipped[-1] ^= 0x40  # payload bit flip: checksum mismatch
    header_flip = bytearray(data)
    header_flip[20] ^= 0x01
    return {
        "bitflip": bytes(flipped),
        "header": bytes(header_flip),
        "truncated": bytes(data[: len(data) // 2]),
        "empty": b"",
        "foreign": b"not a chunk at all" * 10,
    }


class StoreSuite:
    """Contract tests for :class:`~chunkstore.backends.base.Store` implementations."""

    persistent: bool = True
    """Whether a second store object over the same location sees the first one's chunks."""
    time_resolution: float = 0.05
    """Seconds between two events for the store's timestamps to tell them apart (S3: 1 s)."""
    replace_may_miss: bool = False
    """Whether a read racing a put that replaces the same chunk may miss it (JuiceFS)."""

    @pytest.fixture
    def store(self, make_store: Callable[[], Store]) -> Iterator[Store]:
        s = make_store()
        yield s
        s.close()

    @pytest.fixture
    def chunks(self) -> list[MadeChunk]:
        return sample_chunks(6, seed=11)

    # --- basics ---------------------------------------------------------------------

    def test_missing_is_none(self, store: Store, chunks: list[MadeChunk]) -> None:
        key = chunks[0].key
        assert store.get(key) is None
        assert store.exists(key) is False
        assert store.get_many([key, chunks[1].key]) == [None, None]
        assert store.delete(key) is False
        assert store.corrupt_detected == 0

    def test_put_get_exact_bytes(self, store: Store, chunks: list[MadeChunk]) -> None:
        assert store.put_many([(c.key, c.data) for c in chunks]) == [True] * len(chunks)
        got = store.get_many([c.key for c in chunks])
        assert [bytes(g) for g in got if g is not None] == [c.data for c in chunks]
        assert store.exists_many([c.key for c in chunks]) == [True] * len(chunks)

    def test_accepts_any_buffer(self, store: Store, chunks: list[MadeChunk]) -> None:
        a, b, c = chunks[:3]
        store.put(a.key, bytearray(a.data))
        store.put(b.key, memoryview(b.data))
        store.put(c.key, np.frombuffer(c.data, dtype=np.uint8))
        for chunk in (a, b, c):
            assert bytes(store.get(chunk.key) or b"") == chunk.data

    def test_batch_order_and_duplicates(self, store: Store, chunks: list[MadeChunk]) -> None:
        a, b = chunks[:2]
        store.put(b.key, b.data)
        got = store.get_many([b.key, a.key, b.key])
        assert got[1] is None
        assert bytes(got[0] or b"") == b.data and bytes(got[2] or b"") == b.data
        assert store.exists_many([a.key, b.key, a.key]) == [False, True, False]

    def test_overwrite(self, store: Store) -> None:
        first = sample_chunks(1, seed=1)[0]
        # same key, different bytes: a chunk of another layout that carries the same key
        second = _rekeyed(first)
        assert second != first.data
        assert store.put(first.key, first.data)
        assert store.put(first.key, second)
        assert bytes(store.get(first.key) or b"") == second

    def test_put_if_absent_first_wins(self, store: Store, chunks: list[MadeChunk]) -> None:
        a, b = chunks[:2]
        assert store.put_if_absent(a.key, a.data) is True
        assert store.put_if_absent(a.key, a.data) is False
        assert store.put_if_absent_many([(a.key, a.data), (b.key, b.data)]) == [False, True]
        assert bytes(store.get(a.key) or b"") == a.data

    def test_delete(self, store: Store, chunks: list[MadeChunk]) -> None:
        store.put_many([(c.key, c.data) for c in chunks[:3]])
        assert store.delete(chunks[0].key) is True
        assert store.delete(chunks[0].key) is False
        assert store.delete_many([c.key for c in chunks]) == 2
        assert store.get(chunks[1].key) is None
        assert list(store.list()) == []

    # --- listing ----------------------------------------------------------------------

    def test_list(self, store: Store, chunks: list[MadeChunk]) -> None:
        before = time.time() - 5
        store.put_many([(c.key, c.data) for c in chunks])
        other = sample_chunks(2, seed=3, layout=ChunkLayout(small_spec(head_dim=16)))
        store.put_many([(c.key, c.data) for c in other])
        infos = {i.key: i for i in store.list()}
        assert set(infos) == {c.key for c in chunks + other}
        for c in chunks + other:
            info = infos[c.key]
            assert info.size == len(c.data)
            assert before <= info.mtime <= time.time() + 5
            assert info.atime >= info.mtime - 1e-3
        ns = chunks[0].key.namespace
        assert ns != other[0].key.namespace
        assert {i.key for i in store.list(ns)} == {c.key for c in chunks}
        assert list(store.list("0" * 16)) == []

    @pytest.mark.parametrize("namespace", ["..", "../etc", "a/b", "ABCDEF0123456789", "", "0" * 15])
    def test_list_refuses_what_is_not_a_namespace(self, store: Store, namespace: str) -> None:
        # A path-like value would otherwise walk outside the store's root or prefix.
        with pytest.raises(ConfigError, match="16 lower-case hex digits"):
            list(store.list(namespace))

    def test_reads_advance_access_time(
        self, make_store: Callable[..., Store], chunks: list[MadeChunk]
    ) -> None:
        store = make_store()
        try:
            if hasattr(store, "access_resolution"):
                store.access_resolution = 0.0
            store.put_many([(c.key, c.data) for c in chunks[:2]])
            first = {i.key: i.atime for i in store.list()}
            time.sleep(self.time_resolution)
            assert store.get(chunks[0].key) is not None
            after = access_times(store)
            assert after[chunks[0].key] > first[chunks[0].key]
            assert after[chunks[1].key] == pytest.approx(first[chunks[1].key], abs=1e-3)
        finally:
            store.close()

    def test_unchecked_reads_leave_access_time(
        self, make_store: Callable[..., Store], chunks: list[MadeChunk]
    ) -> None:
        """``read_unchecked_many`` (verify, cp, inspect) is not a use: ``prune --max-bytes``
        must see the same least-recently-used order afterwards."""
        store = make_store()
        try:
            if hasattr(store, "access_resolution"):
                store.access_resolution = 0.0
            store.put_many([(c.key, c.data) for c in chunks[:2]])
            first = {i.key: i.atime for i in store.list()}
            time.sleep(0.05)  # a recorded access would now carry a later time
            got = store.read_unchecked_many([chunks[0].key, chunks[2].key])
            assert bytes(got[0] or b"") == chunks[0].data and got[1] is None
            assert access_times(store) == first
        finally:
            store.close()

    # --- prefix lookup ----------------------------------------------------------------

    def test_lookup_prefix(self, store: Store, chunks: list[MadeChunk]) -> None:
        keys = [c.key for c in chunks]
        assert store.lookup_prefix([]) == 0
        assert store.lookup_prefix(keys) == 0
        store.put_many([(c.key, c.data) for c in chunks[:4]])
        assert store.lookup_prefix(keys) == 4
        assert store.lookup_prefix(keys[:3]) == 3
        store.put_many([(c.key, c.data) for c in chunks[4:]])
        assert store.lookup_prefix(keys) == len(keys)

    # --- corruption -------------------------------------------------------------------

    @pytest.mark.parametrize("damage", ["bitflip", "header", "truncated", "empty", "foreign"])
    def test_corrupt_is_a_counted_miss(
        self, store: Store, chunks: list[MadeChunk], damage: str
    ) -> None:
        good, bad = chunks[0], chunks[1]
        store.put(good.key, good.data)
        store.put(bad.key, corrupt_copies(bad)[damage])
        assert store.get_many([good.key, bad.key])[1] is None
        assert store.corrupt_detected == 1
        assert store.exists(bad.key) is False  # moved out of the serving path
        assert bytes(store.get(good.key) or b"") == good.data
        assert {i.key for i in store.list()} == {good.key}

    def test_newer_major_version_is_a_plain_miss(
        self, store: Store, chunks: list[MadeChunk]
    ) -> None:
        """A chunk a newer chunkstore wrote (next major format) into a shared store: a miss
        for this reader, but not damage. Counting or quarantining it would let every old
        reader destroy the upgraded writers' cache during a rolling upgrade."""
        newer, good = chunks[0], chunks[1]
        data = newer_major_copy(newer)
        store.put_many([(newer.key, data), (good.key, good.data)])
        assert store.get(newer.key) is None
        assert store.get_many([good.key, newer.key])[1] is None
        if isinstance(store, SupportsGetInto):
            assert store.get_into(newer.key, bytearray(len(data) + 4096)) is None
        assert store.corrupt_detected == 0
        assert store.exists(newer.key) is True  # left where it is, for the newer readers
        assert bytes(store.read_unchecked_many([newer.key])[0] or b"") == data
        assert {i.key for i in store.list()} == {newer.key, good.key}

    def test_unsupported_reads_leave_access_time(
        self, make_store: Callable[..., Store], chunks: list[MadeChunk]
    ) -> None:
        """A chunk this reader cannot use ages out (spec section 6.7): missing it is not a
        use, so ``prune`` and capacity eviction see it as old as its last real use."""
        store = make_store()
        try:
            if store.unsupported_grace is None:
                pytest.skip(f"{type(store).__name__} holds no other writers' chunks")
            if hasattr(store, "access_resolution"):
                store.access_resolution = 0.0
            newer = chunks[0]
            store.put(newer.key, newer_major_copy(newer))
            first = {i.key: i.atime for i in store.list()}
            time.sleep(self.time_resolution)
            assert store.get(newer.key) is None
            assert access_times(store) == first
        finally:
            store.close()

    def test_put_if_absent_replaces_an_old_unsupported_chunk(
        self, store: Store, chunks: list[MadeChunk]
    ) -> None:
        """spec section 6.7: a chunk of an unknown major keeps its key a miss only for the
        grace after its write; then put-if-absent writes a chunk every reader reads."""
        if store.unsupported_grace is None:
            pytest.skip(f"{type(store).__name__} keeps no write times of other writers")
        chunk = chunks[0]
        newer = newer_major_copy(chunk)
        store.put(chunk.key, newer)
        assert store.put_if_absent(chunk.key, chunk.data) is False  # within the grace
        assert bytes(store.read_unchecked_many([chunk.key])[0] or b"") == newer
        store.unsupported_grace = 0.0
        time.sleep(self.time_resolution)
        assert store.put_if_absent_many([(chunk.key, chunk.data)]) == [True]
        assert bytes(store.get(chunk.key) or b"") == chunk.data
        assert store.put_if_absent(chunk.key, chunk.data) is False  # a usable chunk stays
        assert store.corrupt_detected == 0

    def test_wrong_key_is_a_miss(self, store: Store, chunks: list[MadeChunk]) -> None:
        a, b = chunks[:2]
        store.put(a.key, b.data)  # valid chunk stored under another key
        assert store.get(a.key) is None
        assert store.corrupt_detected == 1

    def test_get_into(self, store: Store, chunks: list[MadeChunk]) -> None:
        if not isinstance(store, SupportsGetInto):
            pytest.skip("store has no get_into fast path")
        a, b = chunks[:2]
        store.put(a.key, a.data)
        buf = np.zeros(len(a.data) + 4096, dtype=np.uint8)
        assert store.get_into(a.key, buf) == len(a.data)
        assert buf[: len(a.data)].tobytes() == a.data
        assert store.get_into(b.key, buf) is None
        store.put(b.key, corrupt_copies(b)["bitflip"])
        assert store.get_into(b.key, bytearray(len(b.data))) is None
        assert store.corrupt_detected == 1

    # --- batches: order and per-chunk results as a loop of single calls would give --------

    def stock_mixed(self, store: Store, chunks: list[MadeChunk]) -> list[Any]:
        """Store chunks 0, 2, 4 whole and 3 bit-flipped (1 and 5 stay missing); the bytes
        each key should read as, in chunk order."""
        store.put_many([(chunks[i].key, chunks[i].data) for i in (0, 2, 4)])
        store.put(chunks[3].key, corrupt_copies(chunks[3])["bitflip"])
        return [chunks[0].data, None, chunks[2].data, None, chunks[4].data, None]

    def test_batched_get_keeps_order_and_per_chunk_results(
        self, store: Store, chunks: list[MadeChunk]
    ) -> None:
        expected = self.stock_mixed(store, chunks)
        order = [4, 3, 0, 1, 2, 5, 0]
        got = store.get_many([chunks[i].key for i in order])
        assert [None if g is None else bytes(g) for g in got] == [expected[i] for i in order]
        assert store.corrupt_detected == 1

    def test_batched_get_into_keeps_order_and_per_chunk_results(
        self, store: Store, chunks: list[MadeChunk]
    ) -> None:
        if not isinstance(store, SupportsGetManyInto):
            pytest.skip("store has no batched get_into")
        expected = self.stock_mixed(store, chunks)
        order = [5, 2, 3, 0, 4, 1]
        room = max(len(c.data) for c in chunks) + 4096
        buffers = [bytearray(room) for _ in order]
        sizes = store.get_many_into([chunks[i].key for i in order], buffers)
        assert sizes == [None if expected[i] is None else len(expected[i]) for i in order]
        for i, size, buffer in zip(order, sizes, buffers):
            if size is not None:
                assert bytes(buffer[:size]) == expected[i]
        assert store.corrupt_detected == 1
        with pytest.raises(ChunkStoreError):
            store.get_many_into([chunks[0].key], [])
        assert store.get_many_into([], []) == []

    def test_batched_puts_keep_per_item_results(
        self, store: Store, chunks: list[MadeChunk]
    ) -> None:
        a, b, c = chunks[:3]
        assert store.put_if_absent_many([(a.key, a.data), (a.key, a.data), (b.key, b.data)]) == [
            True,
            False,
            True,
        ]
        assert store.put_if_absent_many([(b.key, b.data), (c.key, c.data)]) == [False, True]
        replaced = _rekeyed(a)
        assert store.put_many([(a.key, a.data), (a.key, replaced)]) == [True, True]
        assert bytes(store.get(a.key) or b"") == replaced  # the last copy wins, as in a loop
        assert store.put_many([]) == [] and store.put_if_absent_many([]) == []

    def test_batched_put_with_a_failing_item(self, store: Store, chunks: list[MadeChunk]) -> None:
        """One item that cannot be written fails the call; every other item of the batch is
        then stored whole or not at all, and the store keeps working."""
        a, b, c = chunks[:3]
        with pytest.raises((TypeError, ValueError, ChunkStoreError)):
            store.put_many([(a.key, a.data), (b.key, object()), (c.key, c.data)])
        for chunk in (a, c):
            data = store.get(chunk.key)
            assert data is None or bytes(data) == chunk.data
        assert store.get(b.key) is None
        assert store.corrupt_detected == 0
        assert store.put_many([(b.key, b.data)]) == [True]
        assert bytes(store.get(b.key) or b"") == b.data

    def test_read_ranges(self, store: Store, chunks: list[MadeChunk]) -> None:
        if not isinstance(store, SupportsRangedRead):
            pytest.skip("store has no ranged reads")
        a = chunks[0]
        layout = ChunkLayout(small_spec())
        store.put(a.key, a.data)
        ranges = layout.rank_ranges(1, 2)
        got = store.read_ranges(a.key, ranges)
        assert got == [a.data[r.offset : r.offset + r.length] for r in ranges]
        assert store.read_ranges(chunks[1].key, ranges) is None

    # --- persistence and concurrency -----------------------------------------------------

    def test_fresh_store_sees_everything(
        self, make_store: Callable[[], Store], chunks: list[MadeChunk]
    ) -> None:
        if not self.persistent:
            pytest.skip("store does not outlive its object")
        first = make_store()
        first.put_many([(c.key, c.data) for c in chunks])
        first.close()
        second = make_store()
        try:
            assert second.lookup_prefix([c.key for c in chunks]) == len(chunks)
            assert {i.key for i in second.list()} == {c.key for c in chunks}
            assert bytes(second.get(chunks[-1].key) or b"") == chunks[-1].data
        finally:
            second.close()

    def test_concurrent_writers_same_key(self, store: Store, chunks: list[MadeChunk]) -> None:
        target = chunks[0]
        errors: list[BaseException] = []
        wins: list[bool] = []
        misses: list[int] = []

        def writer(i: int) -> None:
            try:
                if i % 2:
                    store.put(target.key, target.data)
                else:
                    wins.append(store.put_if_absent(target.key, target.data))
                data = store.get(target.key)
                if data is None:
                    misses.append(i)
                else:
                    decode_chunk(data, expected_key=target.key.digest)
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], errors
        assert store.corrupt_detected == 0  # whole chunks or misses, never a torn one
        if not self.replace_may_miss:
            assert misses == []
        data = store.get(target.key)  # once the writers are done, it is there
        assert data is not None
        decode_chunk(data, expected_key=target.key.digest)
        assert sum(wins) <= 1

    def test_context_manager(self, make_store: Callable[[], Store]) -> None:
        with make_store() as s:
            assert isinstance(s, Store)
            assert s.supports_listing in (True, False)
            assert s.atomic_put is True


def access_times(store: Store) -> dict[Any, float]:
    """Each stored chunk's access time, once access records written in the background are."""
    flush = getattr(store, "flush", None)
    if flush is not None:
        flush()
    return {i.key: i.atime for i in store.list()}


def newer_major_copy(chunk: MadeChunk) -> bytes:
    """``chunk`` as a future chunkstore would label it: format major version 2."""
    current = b'"chunkstore":"1.0"'
    assert chunk.data.count(current) == 1
    return chunk.data.replace(current, b'"chunkstore":"2.0"')


def _rekeyed(target: MadeChunk) -> bytes:
    """A valid chunk of another layout that carries ``target``'s key, parent and tokens."""
    layout = ChunkLayout(small_spec(num_kv_heads=2))
    data: Any = encode_chunk(
        layout,
        key=target.key.digest,
        parent=target.parent,
        namespace=target.key.namespace,
        tokens=target.tokens,
        tensors=kv_tensors(layout, target.tokens),
    )
    return bytes(data)


__all__ = ["StoreSuite", "corrupt_copies", "newer_major_copy"]
