"""ZstdStore: chunks stored compressed, served uncompressed, byte for byte.

(Not the store suite: it stores chunks, not arbitrary bytes, and lists compressed sizes.)
"""

from __future__ import annotations

import pytest

from chunkstore.backends import ZstdStore
from chunkstore.backends._memory import MemoryStore
from chunkstore.format import _chunk, read_header
from chunkstore.testing.factories import sample_chunks
from tests.tiering.doubles import VerifyTurnedOnDuringRead


def test_the_inner_store_holds_compressed_chunks_the_wrapper_serves_uncompressed() -> None:
    inner = MemoryStore(name="cold")
    store = ZstdStore(inner)
    assert (store.name, store.kind) == ("cold", "memory")
    chunks = sample_chunks(3)
    assert store.put_many([(c.key, c.data) for c in chunks[:2]]) == [True] * 2
    assert store.put_if_absent_many([(c.key, c.data) for c in chunks]) == [False, False, True]
    for chunk in chunks:
        assert read_header(inner.get(chunk.key)).compression == "zstd"
    assert store.get_many([c.key for c in chunks]) == [c.data for c in chunks]
    assert store.read_unchecked_many([chunks[0].key]) == [chunks[0].data]
    assert store.lookup_prefix([c.key for c in chunks]) == 3
    assert sorted(i.key for i in store.list()) == sorted(c.key for c in chunks)


def test_a_corrupt_chunk_is_a_miss_the_inner_store_counts() -> None:
    inner = MemoryStore()
    store = ZstdStore(inner)
    chunk = sample_chunks(1)[0]
    store.put(chunk.key, chunk.data)
    damaged = bytearray(inner.get(chunk.key))
    damaged[-1] ^= 0x01
    inner.put(chunk.key, damaged)
    assert store.get(chunk.key) is None
    assert store.corrupt_detected == inner.corrupt_detected == 1


@pytest.mark.parametrize("inner_verifies", [True, False])
def test_a_compressed_chunk_is_hashed_once_per_read(
    monkeypatch: pytest.MonkeyPatch, inner_verifies: bool
) -> None:
    """A verifying inner store checks the compressed chunk; decompressing it (under the
    zstd frame's own content checksum and size) does not hash it again, and the wrapper says
    it verifies, so a caller does not check the served chunk a third time. Over an inner
    store that does not verify, decompressing is the one check."""
    inner = MemoryStore(verify=inner_verifies)
    store = ZstdStore(inner)
    assert store.verify is inner_verifies
    chunk = sample_chunks(1, seed=5)[0]
    store.put(chunk.key, chunk.data)
    packed = inner.read_unchecked_many([chunk.key])[0]
    assert packed is not None
    stored = bytes(packed[read_header(packed).data_offset :])
    hashed: list[bytes] = []
    real = _chunk._checksum
    monkeypatch.setattr(
        _chunk, "_checksum", lambda head, data: hashed.append(bytes(data)) or real(head, data)
    )
    assert store.get(chunk.key) == chunk.data
    assert hashed.count(stored) == 1


def test_verify_turned_on_during_a_read_does_not_vouch_for_what_it_returned() -> None:
    """Decompressing skips the checksum only for bytes the inner store checked: its
    ``verify`` as the read began. A damaged header read unchecked was re-sealed with a fresh
    checksum (served as a valid chunk, its damage hidden from every later check) when the
    flag was read after the read."""
    from chunkstore.backends.base import judge

    inner = VerifyTurnedOnDuringRead(verify=False)
    store = ZstdStore(inner)
    chunk = sample_chunks(1)[0]
    packed = bytearray(_chunk.recompress(chunk.data, "zstd"))
    header = read_header(packed)
    digit = bytes(packed[: header.data_offset]).index(header.fingerprint.hex().encode())
    packed[digit] = ord("0") if packed[digit] != ord("0") else ord("1")  # damaged, still parses
    inner.put(chunk.key, bytes(packed))
    served = store.get(chunk.key)
    assert served is None or not judge(chunk.key, served).ok
