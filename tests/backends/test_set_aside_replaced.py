"""Setting a corrupt chunk aside on every store with access to a shared medium (a local
directory, any fsspec filesystem, S3): what goes to quarantine, or is deleted, is the very
file or object that was read and judged, never a good copy a writer put in its place since.

Local files are told apart by inode, fsspec files by content, S3 objects by ETag; the
local store's finer races are in ``test_fs_replaced.py``.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._fsio import FsspecIO
from chunkstore.backends.base import Store
from chunkstore.errors import ChecksumMismatch
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

CHUNK = sample_chunks(1, seed=53)[0]
BAD = corrupt_copies(CHUNK)["bitflip"]
EARLIER_BAD = corrupt_copies(CHUNK)["truncated"]


@dataclass
class Shared:
    """A store, and a second writer on the same medium (another process, in real life)."""

    store: Any
    writer: Store


def _local(tmp_path: Path, quarantine: str) -> Shared:
    root = str(tmp_path / "s")
    return Shared(FsStore(root, create=True, quarantine=quarantine), FsStore(root))


def _fsspec(tmp_path: Path, quarantine: str) -> Shared:
    fs = fsspec.filesystem("memory")
    root = f"/replaced-{uuid.uuid4().hex}"
    store = FsStore(root, fs=fs, create=True, quarantine=quarantine)
    assert isinstance(store.io, FsspecIO)
    return Shared(store, FsStore(root, fs=fs))


def _s3(request: pytest.FixtureRequest, quarantine: str, **options: Any) -> Shared:
    pytest.importorskip("s3fs")
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    from chunkstore.backends._s3 import S3Store

    def make(**extra: Any) -> S3Store:
        return S3Store(bucket, "p", endpoint_url=endpoint, backoff=0.001, **extra)

    return Shared(make(quarantine=quarantine, **options), make())


KINDS = ["local", "fsspec", "s3", "s3-no-conditional"]


@pytest.fixture(params=KINDS)
def shared_of(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[str], Shared]]:
    """``shared_of(quarantine)`` for each kind of store."""
    made: list[Shared] = []

    def make(quarantine: str = "move") -> Shared:
        if request.param == "local":
            pair = _local(tmp_path, quarantine)
        elif request.param == "fsspec":
            pair = _fsspec(tmp_path, quarantine)
        elif request.param == "s3":
            pair = _s3(request, quarantine)
        else:
            pair = _s3(request, quarantine, conditional_writes=False)
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.store.close()
        pair.writer.close()


@pytest.mark.parametrize("mode", ["quarantine", "delete"])
def test_set_aside_skips_a_chunk_replaced_since_the_read(
    shared_of: Callable[[str], Shared], mode: str
) -> None:
    pair = shared_of("move")
    pair.writer.put(CHUNK.key, BAD)
    [(raw, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    assert bytes(raw) == BAD and ident is not None
    pair.writer.put(CHUNK.key, CHUNK.data)  # a writer repairs it meanwhile
    if mode == "quarantine":
        assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    else:
        assert pair.store.delete_if_unchanged(CHUNK.key, ident) is False
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert pair.store.quarantined() == [] and pair.store.orphans() == []


def _quarantined_bytes(store: Any) -> list[bytes]:
    """The contents of every chunk in ``store``'s quarantine area."""
    if isinstance(store, FsStore):
        return [bytes(store.io.read(q.path)[0]) for q in store.quarantined()]
    return [bytes(store._run(store._get_small, q.path)) for q in store.quarantined()]


def _quarantine_earlier_damage(pair: Shared) -> None:
    """An earlier corrupt copy of the chunk, set aside by a verify run: the evidence later
    set-asides of the same key must not destroy."""
    pair.writer.put(CHUNK.key, EARLIER_BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "TruncatedChunk") is True
    assert _quarantined_bytes(pair.store) == [EARLIER_BAD]


def test_a_set_aside_that_does_not_happen_keeps_the_earlier_quarantined_copy(
    shared_of: Callable[[str], Shared],
) -> None:
    """The chunk was damaged again, read, and then repaired by a writer before it could be
    set aside: the set-aside does not happen, and the copy an earlier one put in quarantine
    stays. (On S3 a server that ignores ``CopySourceIfMatch``, as moto does, copied the
    repaired object over the earlier copy and then removed that copy again.)"""
    pair = shared_of("move")
    _quarantine_earlier_damage(pair)
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    pair.writer.put(CHUNK.key, CHUNK.data)
    assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert _quarantined_bytes(pair.store) == [EARLIER_BAD]


def test_a_second_set_aside_of_a_key_replaces_its_earlier_quarantined_copy(
    shared_of: Callable[[str], Shared],
) -> None:
    """One name per key in quarantine (spec 6.1): a chunk damaged again and set aside
    takes the place of the earlier copy there, as the newest evidence."""
    pair = shared_of("move")
    _quarantine_earlier_damage(pair)
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is True
    assert pair.store.exists(CHUNK.key) is False
    assert _quarantined_bytes(pair.store) == [BAD]


@pytest.mark.parametrize("mode", ["quarantine", "delete"])
def test_set_aside_takes_the_unchanged_chunk(shared_of: Callable[[str], Shared], mode: str) -> None:
    pair = shared_of("move")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    if mode == "quarantine":
        assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "ChecksumMismatch") is True
        assert [Path(q.path).name for q in pair.store.quarantined()] == [f"{CHUNK.key.hex}.kvc"]
    else:
        assert pair.store.delete_if_unchanged(CHUNK.key, ident) is True
        assert pair.store.quarantined() == []
    assert pair.store.exists(CHUNK.key) is False and pair.store.orphans() == []


def _corrupt_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "corrupt chunk" in r.getMessage()]


@pytest.mark.parametrize("quarantine", ["move", "delete"])
def test_read_quarantine_spares_a_good_rewrite(
    shared_of: Callable[[str], Shared],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    quarantine: str,
) -> None:
    """The serving path's quarantine (a verified read found damage, and a writer repaired
    the chunk before it was set aside) leaves the repaired chunk in place, and its warning
    says so (not "quarantined")."""
    pair = shared_of(quarantine)
    pair.writer.put(CHUNK.key, BAD)
    real = pair.store._quarantine

    def rewritten_first(key: Any, reason: str) -> str:
        pair.writer.put(CHUNK.key, CHUNK.data)
        return real(key, reason)

    monkeypatch.setattr(pair.store, "_quarantine", rewritten_first)
    with caplog.at_level(logging.WARNING, logger="chunkstore"):
        assert pair.store.get(CHUNK.key) is None
    assert pair.store.corrupt_detected == 1
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert pair.store.quarantined() == []
    [warning] = _corrupt_warnings(caplog)
    assert CHUNK.key.hex in warning and warning.endswith(
        ": left (replaced or removed since it was read)"
    )


@pytest.mark.parametrize("quarantine", ["move", "delete"])
def test_a_read_logs_the_set_aside_that_happened(
    shared_of: Callable[[str], Shared], caplog: pytest.LogCaptureFixture, quarantine: str
) -> None:
    pair = shared_of(quarantine)
    pair.writer.put(CHUNK.key, BAD)
    with caplog.at_level(logging.WARNING, logger="chunkstore"):
        assert pair.store.get(CHUNK.key) is None
    [warning] = _corrupt_warnings(caplog)
    assert warning.endswith(": quarantined" if quarantine == "move" else ": deleted")
    assert pair.writer.exists(CHUNK.key) is False


def test_a_read_logs_a_set_aside_that_failed(
    shared_of: Callable[[str], Shared],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The medium refuses the set-aside (read-only credentials, a read-only mount): the
    warning says the chunk was not set aside, and why; the read is a miss all the same."""
    pair = shared_of("move")
    pair.writer.put(CHUNK.key, BAD)
    if isinstance(pair.store, FsStore):

        def refused(src: str, dst: str) -> bool:
            raise PermissionError(13, "Read-only file system")

        monkeypatch.setattr(pair.store.io, "move", refused)
    else:
        from botocore.exceptions import ClientError

        real = type(pair.store)._attempt

        async def read_only(self: Any, op: str, kwargs: dict[str, Any]) -> Any:
            if op in ("copy_object", "delete_object", "put_object"):
                error = {"Error": {"Code": "AccessDenied", "Message": "read-only"}}
                raise ClientError({**error, "ResponseMetadata": {"HTTPStatusCode": 403}}, op)
            return await real(self, op, kwargs)

        monkeypatch.setattr(type(pair.store), "_attempt", read_only)
    with caplog.at_level(logging.WARNING, logger="chunkstore"):
        assert pair.store.get(CHUNK.key) is None
    monkeypatch.undo()
    [warning] = _corrupt_warnings(caplog)
    assert ": not set aside: " in warning and "quarantined" not in warning
    assert bytes(pair.writer.read_unchecked_many([CHUNK.key])[0] or b"") == BAD


def test_a_reported_damage_spares_a_good_copy_published_since(
    shared_of: Callable[[str], Shared],
) -> None:
    """A caller that checks what it read (the vLLM tier over an unverified store) reports
    damage; meanwhile another reader set the damaged chunk aside and a writer published a
    good copy. The report does not set the good copy aside."""
    pair = shared_of("move")
    pair.writer.put(CHUNK.key, BAD)
    pair.store.verify = False
    assert bytes(pair.store.get(CHUNK.key) or b"") == BAD  # served unchecked: the caller judges
    assert pair.writer.get(CHUNK.key) is None  # another reader finds it bad, sets it aside
    pair.writer.put(CHUNK.key, CHUNK.data)
    pair.store.report_corrupt(CHUNK.key, ChecksumMismatch("found by the caller"))
    assert pair.store.corrupt_detected == 1
    assert bytes(pair.writer.get(CHUNK.key) or b"") == CHUNK.data
    # and a damaged copy still there is set aside, as before
    pair.writer.put(CHUNK.key, BAD)
    pair.store.report_corrupt(CHUNK.key, ChecksumMismatch("found by the caller"))
    assert pair.writer.exists(CHUNK.key) is False


def test_fsspec_replaced_between_check_and_move_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The narrowest race through fsspec: the file is replaced after the check, just before
    the move; what was moved is compared afterwards, and the good file goes back."""
    pair = _fsspec(tmp_path, "move")
    assert _set_aside_repaired_just_before_the_move(pair, monkeypatch) is False
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert pair.store.quarantined() == [] and pair.store.orphans() == []


def _set_aside_repaired_just_before_the_move(pair: Shared, monkeypatch: pytest.MonkeyPatch) -> bool:
    """A damaged chunk is read and set aside, and a writer repairs it after the check, just
    before the move; what the set-aside returned."""
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    real = pair.store.io.move

    def replaced_first(src: str, dst: str) -> bool:
        if src == pair.store.path_of(CHUNK.key):
            pair.writer.put(CHUNK.key, CHUNK.data)
        return bool(real(src, dst))

    monkeypatch.setattr(pair.store.io, "move", replaced_first)
    try:
        return bool(pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad"))
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("kind", ["local", "fsspec"])
def test_replaced_between_check_and_move_keeps_the_earlier_quarantined_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The file is replaced after the check, just before the move, and quarantine already
    holds an earlier copy of the key: the good file goes back, and the earlier copy stays
    (the move does not land on it before what was moved has been compared)."""
    pair = _local(tmp_path, "move") if kind == "local" else _fsspec(tmp_path, "move")
    _quarantine_earlier_damage(pair)
    assert _set_aside_repaired_just_before_the_move(pair, monkeypatch) is False
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert _quarantined_bytes(pair.store) == [EARLIER_BAD]
    assert pair.store.orphans() == []


@pytest.mark.parametrize("conditional_writes", [True, False])
def test_s3_replaced_between_copy_and_delete_keeps_the_new_object(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, conditional_writes: bool
) -> None:
    """The narrowest race on S3: a writer replaces the object after the copy to quarantine
    and before the delete. The delete is refused (If-Match, or the HEAD before it), the
    copy is removed again, and the new object stays."""
    pair = _s3(request, "move", conditional_writes=conditional_writes)
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    admin = request.getfixturevalue("s3_admin")
    real = type(pair.store)._attempt

    async def rewrite_after_copy(self: Any, op: str, kwargs: dict[str, Any]) -> Any:
        got = await real(self, op, kwargs)
        if op == "copy_object" and self is pair.store:
            # (a plain boto3 client: a store's own calls cannot run inside its event loop)
            name = pair.store.object_key(CHUNK.key)
            admin.put_object(Bucket=pair.store.bucket, Key=name, Body=CHUNK.data)
        return got

    monkeypatch.setattr(type(pair.store), "_attempt", rewrite_after_copy)
    assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    monkeypatch.undo()
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert pair.store.quarantined() == []
    pair.store.close()
    pair.writer.close()


def test_s3_copy_refused_by_its_etag_condition_sets_nothing_aside(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS honours ``CopySourceIfMatch`` (moto ignores it: the other tests take the path
    where the copy is made and removed again): a replaced object's copy is refused with 412,
    nothing is deleted, nothing goes to quarantine."""
    from botocore.exceptions import ClientError

    pair = _s3(request, "move")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    pair.writer.put(CHUNK.key, CHUNK.data)
    admin = request.getfixturevalue("s3_admin")
    real = type(pair.store)._attempt
    calls: list[str] = []

    async def as_aws(self: Any, op: str, kwargs: dict[str, Any]) -> Any:
        calls.append(op)
        if op == "copy_object" and "CopySourceIfMatch" in kwargs:
            source = kwargs["CopySource"]
            head = admin.head_object(Bucket=source["Bucket"], Key=source["Key"])
            if head["ETag"].strip('"') != kwargs["CopySourceIfMatch"].strip('"'):
                error = {"Error": {"Code": "PreconditionFailed"}}
                raise ClientError({**error, "ResponseMetadata": {"HTTPStatusCode": 412}}, op)
        return await real(self, op, kwargs)

    monkeypatch.setattr(type(pair.store), "_attempt", as_aws)
    assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    # (the HEADs: is a copy in quarantine? and, once refused: did another run set it aside?)
    assert calls == ["head_object", "copy_object", "head_object"]
    monkeypatch.undo()
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert pair.store.quarantined() == []
    pair.store.close()
    pair.writer.close()


def test_s3_copy_does_not_overwrite_a_copy_another_reader_set_aside_meanwhile(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quarantine held no copy of the key when the store looked, but another reader set a
    copy aside before the copy landed: with conditional writes the copy carries
    ``If-None-Match: *`` (AWS honours it; moto ignores it, so it is played here), is refused,
    and the other reader's copy stays."""
    from botocore.exceptions import ClientError

    pair = _s3(request, "move")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    admin = request.getfixturevalue("s3_admin")
    dest = pair.store._full(f"quarantine/{CHUNK.key.namespace}/{CHUNK.key.hex}.kvc")
    real = type(pair.store)._attempt

    async def another_reader_first(self: Any, op: str, kwargs: dict[str, Any]) -> Any:
        if op == "copy_object" and self is pair.store:
            admin.put_object(Bucket=pair.store.bucket, Key=dest, Body=EARLIER_BAD)
            if kwargs.get("IfNoneMatch") == "*":
                error = {"Error": {"Code": "PreconditionFailed"}}
                raise ClientError({**error, "ResponseMetadata": {"HTTPStatusCode": 412}}, op)
        return await real(self, op, kwargs)

    monkeypatch.setattr(type(pair.store), "_attempt", another_reader_first)
    assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    monkeypatch.undo()
    assert _quarantined_bytes(pair.store) == [EARLIER_BAD]
    assert bytes(pair.store.read_unchecked_many([CHUNK.key])[0] or b"") == BAD
    pair.store.close()
    pair.writer.close()


@pytest.mark.parametrize("kind", ["local", "fsspec"])
def test_a_concurrent_set_aside_keeps_its_quarantined_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Two verify runs and a writer: after this run found quarantine free for the key,
    another run set the same damaged file aside and a writer repaired the chunk, before this
    run's move. The good file goes back, and the other run's quarantined copy stays (the
    move went straight to the quarantine name when it had been free, so the good file
    landed on that copy and the copy was removed with it)."""
    pair = _local(tmp_path, "move") if kind == "local" else _fsspec(tmp_path, "move")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    other = FsStore(pair.store.root, fs=None if kind == "local" else pair.store.io.fs)
    real = pair.store.io.move

    def other_run_first(src: str, dst: str) -> bool:
        if src == pair.store.path_of(CHUNK.key):
            monkeypatch.setattr(pair.store.io, "move", real)
            assert other.quarantine_if_unchanged(CHUNK.key, ident, "found by the other run")
            pair.writer.put(CHUNK.key, CHUNK.data)
        return bool(real(src, dst))

    monkeypatch.setattr(pair.store.io, "move", other_run_first)
    assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert _quarantined_bytes(pair.store) == [BAD]
    assert pair.store.orphans() == []
    other.close()


def test_s3_a_failed_write_over_the_earlier_copy_leaves_its_reason(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Where quarantine holds an earlier copy and the newer one, read and deleted, cannot be
    written over it (logged), the earlier copy keeps the reason it was set aside for: the
    newer reason used to be written beside it, so ``quarantined`` showed the earlier damage
    under the later verdict."""
    from botocore.exceptions import ClientError

    pair = _s3(request, "move")
    _quarantine_earlier_damage(pair)
    [aside] = pair.store.quarantined()
    reason_name = aside.path + ".reason"

    def reason_there() -> str:
        return bytes(pair.store._run(pair.store._get_small, reason_name)).decode()

    assert "TruncatedChunk" in reason_there()
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    real = type(pair.store)._attempt

    async def quarantine_copy_refused(self: Any, op: str, kwargs: dict[str, Any]) -> Any:
        if op == "put_object" and kwargs.get("Key") == aside.path:
            error = {"Error": {"Code": "AccessDenied", "Message": "refused"}}
            raise ClientError({**error, "ResponseMetadata": {"HTTPStatusCode": 403}}, op)
        return await real(self, op, kwargs)

    monkeypatch.setattr(type(pair.store), "_attempt", quarantine_copy_refused)
    with caplog.at_level(logging.WARNING, logger="chunkstore"):
        assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "ChecksumMismatch") is True
    monkeypatch.undo()
    assert any("not written to quarantine" in r.getMessage() for r in caplog.records)
    assert pair.store.exists(CHUNK.key) is False
    assert _quarantined_bytes(pair.store) == [EARLIER_BAD]
    assert "TruncatedChunk" in reason_there() and "ChecksumMismatch" not in reason_there()


def _sweep_right_after_the_move(pair: Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process's ``prune``/``verify`` sweeps orphan temp files, with no grace at
    all, the moment the chunk has left its name. (A file staged beside the chunk kept the
    chunk's old mtime, so for an old chunk the default grace of an hour did the same.)"""
    sweeper = FsStore(pair.store.root, fs=pair.store.io.fs if _on_fsspec(pair) else None)
    real = pair.store.io.move

    def swept_after(src: str, dst: str) -> bool:
        moved = bool(real(src, dst))
        if src == pair.store.path_of(CHUNK.key):
            sweeper.remove_orphans(0.0)
        return moved

    monkeypatch.setattr(pair.store.io, "move", swept_after)


def _on_fsspec(pair: Shared) -> bool:
    return isinstance(pair.store.io, FsspecIO)


@pytest.mark.parametrize("kind", ["local", "fsspec"])
def test_an_orphan_sweep_during_a_set_aside_keeps_the_quarantined_copy(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    """The damaged chunk on its way to quarantine is no orphan: a sweep between its leaving
    the chunk's name and its landing in quarantine does not delete it (it used to be staged
    beside the chunk under a temp name, and the sweep took it: the copy was lost, with a
    warning)."""
    pair = _local(tmp_path, "move") if kind == "local" else _fsspec(tmp_path, "move")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    _sweep_right_after_the_move(pair, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="chunkstore"):
        assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is True
    monkeypatch.undo()
    assert _quarantined_bytes(pair.store) == [BAD]
    assert pair.store.exists(CHUNK.key) is False
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("kind", ["local", "fsspec"])
@pytest.mark.parametrize("mode", ["quarantine", "delete"])
def test_an_orphan_sweep_during_a_set_aside_keeps_a_good_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, mode: str
) -> None:
    """A writer repaired the chunk just before the move, and a sweep runs right after it:
    what was moved is the good file, and it still goes back to its name."""
    pair = _local(tmp_path, "move") if kind == "local" else _fsspec(tmp_path, "move")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    _sweep_right_after_the_move(pair, monkeypatch)
    swept = pair.store.io.move

    def replaced_first(src: str, dst: str) -> bool:
        if src == pair.store.path_of(CHUNK.key):
            pair.writer.put(CHUNK.key, CHUNK.data)
        return swept(src, dst)

    monkeypatch.setattr(pair.store.io, "move", replaced_first)
    if mode == "quarantine":
        assert pair.store.quarantine_if_unchanged(CHUNK.key, ident, "bad") is False
    else:
        assert pair.store.delete_if_unchanged(CHUNK.key, ident) is False
    monkeypatch.undo()
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert pair.store.quarantined() == []


def _another_run_sets_it_aside(admin: Any, store: Any) -> None:
    """Another verify run (or reader) sets the damaged object aside as a store does: a copy
    to its quarantine name, then the delete. (A plain boto3 client: a store's own calls
    cannot run inside its event loop.)"""
    name = store.object_key(CHUNK.key)
    dest = store._full(f"quarantine/{CHUNK.key.namespace}/{CHUNK.key.hex}.kvc")
    admin.copy_object(
        Bucket=store.bucket, Key=dest, CopySource={"Bucket": store.bucket, "Key": name}
    )
    admin.delete_object(Bucket=store.bucket, Key=name)


@pytest.mark.parametrize("earlier_copy", [False, True])
def test_s3_a_read_says_when_another_run_set_the_chunk_aside_first(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    earlier_copy: bool,
) -> None:
    """A read found damage, and another run set the same object aside between this store's
    look at quarantine and its own copy (or, with an earlier copy of the key in quarantine,
    its read of the object): the object is gone from its name because it is in quarantine,
    and the warning says so, not "replaced or removed"."""
    pair = _s3(request, "move")
    if earlier_copy:
        _quarantine_earlier_damage(pair)
    pair.writer.put(CHUNK.key, BAD)
    admin = request.getfixturevalue("s3_admin")
    real = type(pair.store)._attempt
    first = "get_object" if earlier_copy else "copy_object"
    gets: list[str] = []

    async def other_run_first(self: Any, op: str, kwargs: dict[str, Any]) -> Any:
        if op == "get_object" and self is pair.store:
            gets.append(kwargs["Key"])
        # the serving read and its judging read again come first; then the set-aside
        if op == first and self is pair.store and (op == "copy_object" or len(gets) == 3):
            _another_run_sets_it_aside(admin, pair.store)
        return await real(self, op, kwargs)

    monkeypatch.setattr(type(pair.store), "_attempt", other_run_first)
    _a_read_says_another_run_set_it_aside(pair, monkeypatch, caplog)
    assert pair.writer.exists(CHUNK.key) is False
    pair.store.close()
    pair.writer.close()


def test_s3_a_read_says_when_its_copy_was_refused_for_another_runs_copy(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As AWS does with ``If-None-Match: *`` (moto ignores it, so it is played here): the
    copy to quarantine is refused because another run's copy landed there since this store
    looked; the object itself is still at its name (the other run's delete is yet to come).
    The warning says it was set aside by another run."""
    from botocore.exceptions import ClientError

    pair = _s3(request, "move")
    pair.writer.put(CHUNK.key, BAD)
    admin = request.getfixturevalue("s3_admin")
    dest = pair.store._full(f"quarantine/{CHUNK.key.namespace}/{CHUNK.key.hex}.kvc")
    real = type(pair.store)._attempt

    async def refused_for_the_other_copy(self: Any, op: str, kwargs: dict[str, Any]) -> Any:
        if op == "copy_object" and self is pair.store:
            source = kwargs["CopySource"]
            admin.copy_object(Bucket=pair.store.bucket, Key=dest, CopySource=source)
            assert kwargs.get("IfNoneMatch") == "*"
            error = {"Error": {"Code": "PreconditionFailed"}}
            raise ClientError({**error, "ResponseMetadata": {"HTTPStatusCode": 412}}, op)
        return await real(self, op, kwargs)

    monkeypatch.setattr(type(pair.store), "_attempt", refused_for_the_other_copy)
    _a_read_says_another_run_set_it_aside(pair, monkeypatch, caplog)
    pair.store.close()
    pair.writer.close()


def _a_read_says_another_run_set_it_aside(
    pair: Shared, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read of the damaged chunk, with the S3 calls patched to play the other run, is a
    miss whose warning says another run set it aside; quarantine holds the damaged copy."""
    with caplog.at_level(logging.WARNING, logger="chunkstore"):
        assert pair.store.get(CHUNK.key) is None
    monkeypatch.undo()
    [warning] = _corrupt_warnings(caplog)
    assert warning.endswith(": left (already set aside by another run)"), warning
    assert _quarantined_bytes(pair.store) == [BAD]


@pytest.mark.parametrize("refusal", [errno.EACCES, errno.EXDEV, errno.EROFS])
def test_a_delete_the_state_directory_refuses_stages_beside_the_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    """Where ``.chunkstore/`` is another user's (a shared mount), read-only or on another
    filesystem, a damaged chunk is still deleted: the delete stages it beside the chunk, as
    it did before staging moved there (it used to be logged "not set aside" and left)."""
    pair = _local(tmp_path, "delete")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    state = os.path.join(pair.store.root, ".chunkstore")
    real = pair.store.io.move

    def state_dir_refused(src: str, dst: str) -> bool:
        if dst.startswith(state + os.sep):
            raise OSError(refusal, os.strerror(refusal), dst)
        return bool(real(src, dst))

    monkeypatch.setattr(pair.store.io, "move", state_dir_refused)
    assert pair.store.delete_if_unchanged(CHUNK.key, ident) is True
    monkeypatch.undo()
    assert pair.store.exists(CHUNK.key) is False
    assert pair.store.orphans() == []  # nothing left beside the chunk either
    assert _quarantined_bytes(pair.store) == []


def test_a_delete_beside_the_chunk_still_puts_a_good_rewrite_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback keeps the guard: a good copy written over the damaged one between the
    read and the delete is put back, not deleted."""
    pair = _local(tmp_path, "delete")
    pair.writer.put(CHUNK.key, BAD)
    [(_, ident)] = pair.store.read_unchecked_with_idents([CHUNK.key])
    pair.writer.put(CHUNK.key, CHUNK.data)  # a writer repaired it meanwhile
    state = os.path.join(pair.store.root, ".chunkstore")
    real = pair.store.io.move

    def state_dir_refused(src: str, dst: str) -> bool:
        if dst.startswith(state + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", dst)
        return bool(real(src, dst))

    monkeypatch.setattr(pair.store.io, "move", state_dir_refused)
    assert pair.store.delete_if_unchanged(CHUNK.key, ident) is False
    monkeypatch.undo()
    assert bytes(pair.store.get(CHUNK.key) or b"") == CHUNK.data
    assert pair.store.orphans() == []
