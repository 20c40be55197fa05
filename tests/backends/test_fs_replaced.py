"""FsStore on a shared directory where another writer replaces a chunk file between two
steps of ours: recording an access, and setting a corrupt chunk aside, act on the very file
that was read, never on its replacement."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import MadeChunk, sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

CHUNK = sample_chunks(1, seed=43)[0]
ODD_MTIME_NS = 1_700_000_000_123_456_789  # not representable as a float to the nanosecond


def _replace_with(
    store: FsStore, chunk: MadeChunk, data: bytes, mtime_ns: int | None = None
) -> os.stat_result:
    """Publish ``data`` at ``chunk``'s path as another writer would: temp file + rename."""
    path = store.path_of(chunk.key)
    tmp = path + ".other-writer.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    if mtime_ns is not None:
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
    os.replace(tmp, path)
    return os.stat(path)


@pytest.fixture
def store(tmp_path: Path) -> FsStore:
    return FsStore(str(tmp_path / "s"), create=True, access_resolution=0)


# --- access times (review #25) --------------------------------------------------------------


def test_access_keeps_mtime_to_the_nanosecond(store: FsStore) -> None:
    store.put(CHUNK.key, CHUNK.data)
    path = store.path_of(CHUNK.key)
    os.utime(path, ns=(ODD_MTIME_NS, ODD_MTIME_NS))
    assert store.get(CHUNK.key) is not None
    after = os.stat(path)
    assert after.st_mtime_ns == ODD_MTIME_NS  # `prune --older-than` and the ident rely on it
    assert after.st_atime_ns > ODD_MTIME_NS  # the access was recorded


@pytest.mark.parametrize("read", ["get", "get_into", "read_ranges", "unverified_get"])
def test_access_does_not_touch_a_file_replaced_since_the_read(
    store: FsStore, monkeypatch: pytest.MonkeyPatch, read: str
) -> None:
    store.put(CHUNK.key, CHUNK.data)
    newer: list[os.stat_result] = []
    real = store.io.set_access

    def replaced_first(path: str, now: float, st: Any) -> bool:
        # another writer publishes the same key between our read and our access record
        newer.append(_replace_with(store, CHUNK, CHUNK.data, mtime_ns=ODD_MTIME_NS))
        return real(path, now, st)

    monkeypatch.setattr(store.io, "set_access", replaced_first)
    if read == "get":
        assert store.get(CHUNK.key) is not None
    elif read == "get_into":
        assert store.get_into(CHUNK.key, bytearray(len(CHUNK.data))) == len(CHUNK.data)
    elif read == "read_ranges":
        assert store.read_ranges(CHUNK.key, []) == []
    else:
        store.verify = False
        assert store.get(CHUNK.key) is not None
    assert len(newer) == 1
    now = os.stat(store.path_of(CHUNK.key))
    assert (now.st_ino, now.st_mtime_ns, now.st_atime_ns) == (
        newer[0].st_ino,
        ODD_MTIME_NS,
        newer[0].st_atime_ns,
    )


# --- setting aside only the file that was judged (review #9) ------------------------------------


@pytest.mark.parametrize("mode", ["quarantine", "delete"])
def test_set_aside_skips_a_file_replaced_since_the_read(store: FsStore, mode: str) -> None:
    store.put(CHUNK.key, corrupt_copies(CHUNK)["bitflip"])
    [(raw, ident)] = store.read_unchecked_with_idents([CHUNK.key])  # type: ignore[misc]
    assert raw == corrupt_copies(CHUNK)["bitflip"]
    _replace_with(store, CHUNK, CHUNK.data)  # a writer repairs it meanwhile
    if mode == "quarantine":
        assert store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    else:
        assert store.delete_if_unchanged(CHUNK.key, ident) is False
    assert bytes(store.get(CHUNK.key) or b"") == CHUNK.data
    assert store.quarantined() == [] and store.orphans() == []


@pytest.mark.parametrize("mode", ["quarantine", "delete"])
def test_set_aside_removes_the_unchanged_file(store: FsStore, mode: str) -> None:
    bad = corrupt_copies(CHUNK)["bitflip"]
    store.put(CHUNK.key, bad)
    [(_, ident)] = store.read_unchecked_with_idents([CHUNK.key])  # type: ignore[misc]
    if mode == "quarantine":
        assert store.quarantine_if_unchanged(CHUNK.key, ident, "ChecksumMismatch") is True
        [moved] = store.quarantined()
        assert Path(moved.path).read_bytes() == bad
        assert "ChecksumMismatch" in Path(moved.path + ".reason").read_text()
    else:
        assert store.delete_if_unchanged(CHUNK.key, ident) is True
        assert store.quarantined() == []
    assert store.exists(CHUNK.key) is False and store.orphans() == []


@pytest.mark.parametrize("quarantine", ["move", "delete"])
def test_replaced_between_check_and_move_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quarantine: str
) -> None:
    """The narrowest race: the file is replaced after the ident check, just before the rename.
    What was renamed is compared afterwards, and the good file goes back."""
    store = FsStore(
        str(tmp_path / "s"), create=True, quarantine=quarantine, max_bytes=10 * len(CHUNK.data)
    )
    store.put(CHUNK.key, corrupt_copies(CHUNK)["bitflip"])
    [(_, ident)] = store.read_unchecked_with_idents([CHUNK.key])  # type: ignore[misc]
    real = store.io.move

    def replaced_first(src: str, dst: str) -> bool:
        if src == store.path_of(CHUNK.key):
            _replace_with(store, CHUNK, CHUNK.data)
        return bool(real(src, dst))

    monkeypatch.setattr(store.io, "move", replaced_first)
    assert store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    assert bytes(store.get(CHUNK.key) or b"") == CHUNK.data
    assert store.quarantined() == [] and store.orphans() == []
    assert store.capacity is not None and store.capacity.recount().chunks == 1


def test_read_quarantine_spares_a_good_rewrite(
    store: FsStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving path's quarantine (a verified read found damage) has the same guard."""
    store.put(CHUNK.key, corrupt_copies(CHUNK)["bitflip"])
    real = store._quarantine

    def rewritten_first(key: Any, reason: str) -> str:
        _replace_with(store, CHUNK, CHUNK.data)
        return real(key, reason)

    monkeypatch.setattr(store, "_quarantine", rewritten_first)
    assert store.get(CHUNK.key) is None
    assert store.corrupt_detected == 1
    assert bytes(store.get(CHUNK.key) or b"") == CHUNK.data
    assert store.quarantined() == []
