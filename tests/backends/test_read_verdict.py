"""The one read verdict: which error means which verdict, and what a store does with each."""

from __future__ import annotations

import inspect

import pytest

from chunkstore import errors
from chunkstore.backends._memory import MemoryStore
from chunkstore.backends.base import Judgement, ReadVerdict, judge, verdict_of
from chunkstore.errors import FormatError
from chunkstore.hashing import ChunkKey
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies, newer_major_copy

# Every FormatError of chunkstore.errors, and what a read makes of it. A new subclass
# fails test_every_format_error_has_a_verdict until someone decides its verdict here.
EXPECTED = {
    errors.UnsupportedVersion: ReadVerdict.UNSUPPORTED,
    errors.UnsupportedFeature: ReadVerdict.UNSUPPORTED,
    errors.UnknownDType: ReadVerdict.UNSUPPORTED,
    errors.UnknownCompression: ReadVerdict.UNSUPPORTED,
    errors.SpecMismatch: ReadVerdict.REFUSED,
    errors.AuthenticationError: ReadVerdict.REFUSED,
    errors.FormatError: ReadVerdict.CORRUPT,
    errors.TruncatedChunk: ReadVerdict.CORRUPT,
    errors.BadMagic: ReadVerdict.CORRUPT,
    errors.HeaderTooLarge: ReadVerdict.CORRUPT,
    errors.MalformedHeader: ReadVerdict.CORRUPT,
    errors.LayoutError: ReadVerdict.CORRUPT,
    errors.ChecksumMismatch: ReadVerdict.CORRUPT,
    errors.KeyMismatch: ReadVerdict.CORRUPT,
    errors.CompressionError: ReadVerdict.CORRUPT,
}

CHUNKS = sample_chunks(2, seed=5)


def test_every_format_error_has_a_verdict() -> None:
    declared = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, FormatError)
    }
    assert declared == set(EXPECTED)


@pytest.mark.parametrize(("error", "verdict"), EXPECTED.items(), ids=[e.__name__ for e in EXPECTED])
def test_verdict_of_each_error_class(error: type[FormatError], verdict: ReadVerdict) -> None:
    assert verdict_of(error("x")) is verdict
    judgement = Judgement.of(error("x"))
    assert judgement.verdict is verdict and not judgement.ok
    assert isinstance(judgement.error, error)


def test_judge_a_valid_chunk_is_ok() -> None:
    chunk = CHUNKS[0]
    judgement = judge(chunk.key, chunk.data)
    assert judgement.ok and judgement.error is None
    assert judgement.header is not None and judgement.header.key == chunk.key.digest
    assert judge(chunk.key, memoryview(chunk.data)).ok


@pytest.mark.parametrize("damage", sorted(corrupt_copies(CHUNKS[0])))
def test_judge_damaged_bytes_are_corrupt(damage: str) -> None:
    judgement = judge(CHUNKS[0].key, corrupt_copies(CHUNKS[0])[damage])
    assert judgement.verdict is ReadVerdict.CORRUPT
    assert isinstance(judgement.error, FormatError)


def test_judge_another_keys_chunk_is_corrupt() -> None:
    judgement = judge(CHUNKS[1].key, CHUNKS[0].data)
    assert judgement.verdict is ReadVerdict.CORRUPT
    assert isinstance(judgement.error, errors.KeyMismatch)


def test_judge_a_newer_major_version_is_newer() -> None:
    judgement = judge(CHUNKS[0].key, newer_major_copy(CHUNKS[0]))
    assert judgement.verdict is ReadVerdict.UNSUPPORTED
    assert isinstance(judgement.error, errors.UnsupportedVersion)


def test_judge_another_models_chunk_or_a_missing_mac_is_refused() -> None:
    chunk = CHUNKS[0]
    other_model = judge(chunk.key, chunk.data, expected_fingerprint=b"\x07" * 32)
    assert other_model.verdict is ReadVerdict.REFUSED
    assert isinstance(other_model.error, errors.SpecMismatch)
    no_mac = judge(chunk.key, chunk.data, mac_key=b"k" * 32)
    assert no_mac.verdict is ReadVerdict.REFUSED
    assert isinstance(no_mac.error, errors.AuthenticationError)


def test_a_judgement_carries_an_error_exactly_when_not_ok() -> None:
    with pytest.raises(ValueError, match="error"):
        Judgement(ReadVerdict.OK, errors.ChecksumMismatch("x"))
    with pytest.raises(ValueError, match="error"):
        Judgement(ReadVerdict.CORRUPT)


class RecordingStore(MemoryStore):
    """A memory store that remembers what it was asked to quarantine."""

    def __init__(self) -> None:
        super().__init__()
        self.quarantined: list[tuple[ChunkKey, str]] = []

    def _quarantine(self, key: ChunkKey, reason: str) -> str:
        self.quarantined.append((key, reason))
        return super()._quarantine(key, reason)


@pytest.mark.parametrize(
    ("error", "counted"),
    [
        (errors.ChecksumMismatch("bit flip"), True),
        (errors.UnknownDType("f4e2m1"), False),
        (errors.SpecMismatch("other model"), False),
        (errors.AuthenticationError("no MAC"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_a_store_quarantines_only_corrupt_chunks(error: FormatError, counted: bool) -> None:
    store = RecordingStore()
    chunk = CHUNKS[0]
    store.put(chunk.key, chunk.data)
    assert store._admit(chunk.key, Judgement.of(error)) is False
    assert store.corrupt_detected == int(counted)
    assert store.quarantined == (
        [(chunk.key, f"{type(error).__name__}: {error}")] if counted else []
    )
    assert store.exists(chunk.key) is not counted


def test_a_store_admits_an_ok_chunk() -> None:
    store = RecordingStore()
    assert store._admit(CHUNKS[0].key, Judgement(ReadVerdict.OK)) is True
    assert store.corrupt_detected == 0 and store.quarantined == []


def test_the_cli_words_are_the_verdicts_values() -> None:
    from chunkstore.cli import integrity

    assert {integrity.OK, integrity.UNSUPPORTED, integrity.CORRUPT} == {
        ReadVerdict.OK.value,
        ReadVerdict.UNSUPPORTED.value,
        ReadVerdict.CORRUPT.value,
    }
