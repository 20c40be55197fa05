"""What the maintenance commands need from a store beyond the serving interface.

``verify``, ``cp`` and ``inspect`` must read bytes without validating them
(they report damage themselves), without quarantining, and without counting
as a use (or ``prune --max-bytes`` would see every chunk as just used). Stores
with state to maintain implement
:class:`~chunkstore.backends.maintenance.SupportsMaintenance`; this module
uses it where a store has it and falls back to the
:class:`~chunkstore.backends.base.Store` primitives otherwise (a store
without it has no access records, quarantine area or stray files).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkstore.backends.base import Store, SupportsRangedRead
from chunkstore.backends.maintenance import (
    StoredFile,
    StrandedFile,
    SupportsLoneRecords,
    SupportsMaintenance,
    SupportsStagingSweep,
)
from chunkstore.errors import FormatError
from chunkstore.format import (
    MAX_HEADER_BYTES,
    ByteRange,
    ChunkHeader,
    header_bytes_needed,
    read_header,
)
from chunkstore.hashing import ChunkKey

HEADER_PROBE_BYTES = 64 * 1024
"""First read size for a header: covers every header of a 256-token chunk of a large model."""


@dataclass(frozen=True, slots=True)
class Stray:
    """A file in a store's tree that is not a chunk."""

    path: str
    """Path relative to the store root (full path/URL when the store has no local root)."""
    size: int
    """Bytes."""
    mtime: float
    """Last modification, seconds since the epoch."""
    kind: str
    """``temp`` (a writer's unfinished temp file), ``quarantine``, ``foreign``, or a killed
    set-aside's staged file: ``staged-quarantine`` (a corrupt chunk on its way to quarantine)
    or ``staged-delete`` (a chunk being deleted)."""


def read_raw_many(store: Store, keys: Sequence[ChunkKey]) -> list[Any]:
    """Stored bytes per key (``None`` if gone), unvalidated, not counted as a use."""
    return list(store.read_unchecked_many(keys))


def read_error_count(store: Store) -> int:
    """Reads the store failed with an OS error (EIO, ESTALE, EACCES) so far; 0 if it keeps
    no count (such a store raises instead of serving a miss)."""
    return int(getattr(store, "read_errors", 0))


def unreadable_among(
    store: Store, keys: Sequence[ChunkKey], raws: Sequence[Any], errors_before: int
) -> set[int]:
    """Indices of ``keys`` read as ``None`` that are still there: the store failed to read
    them (its error count rose since ``errors_before``), they did not vanish."""
    if read_error_count(store) == errors_before:
        return set()
    missed = [i for i, raw in enumerate(raws) if raw is None]
    if not missed:
        return set()
    present = store.exists_many([keys[i] for i in missed])
    return {i for i, here in zip(missed, present) if here}


def read_header_of(store: Store, key: ChunkKey) -> ChunkHeader | None:
    """The parsed header of one stored chunk (``None`` if gone); raises ``FormatError`` if bad.

    Reads only the header bytes when the store supports ranged reads.
    """
    return header_reader(store)(key)


def header_reader(store: Store) -> Callable[[ChunkKey], ChunkHeader | None]:
    """:func:`read_header_of` for ``store``, how to read chosen once: for many keys."""
    if not isinstance(store, SupportsRangedRead):

        def whole(key: ChunkKey) -> ChunkHeader | None:
            data = read_raw_many(store, [key])[0]
            return None if data is None else read_header(data)

        return whole
    ranged = store

    def head_only(key: ChunkKey) -> ChunkHeader | None:
        parts = ranged.read_ranges(key, [ByteRange(0, HEADER_PROBE_BYTES)])
        if parts is None:
            return None
        head = bytes(parts[0])
        try:
            needed = header_bytes_needed(head)
        except FormatError:
            needed = len(head)
        # A damaged length prefix can announce up to 2**64 bytes: past the largest header a
        # reader accepts, the probe alone is judged (HeaderTooLarge), nothing more is read.
        if len(head) == HEADER_PROBE_BYTES and len(head) < needed <= 8 + MAX_HEADER_BYTES:
            more = ranged.read_ranges(key, [ByteRange(0, needed)])
            if more is None:
                return None
            head = bytes(more[0])
        return read_header(head)

    return head_only


def _stray(store: SupportsMaintenance, item: StoredFile, kind: str) -> Stray:
    return Stray(
        path=store.relative_path(str(item.path)),
        size=int(item.size),
        mtime=float(item.mtime),
        kind=kind,
    )


@dataclass(frozen=True, slots=True)
class FoundStrays:
    """A store's temp files and foreign files, from one walk (of one shard)."""

    temps: list[tuple[StoredFile, Stray]]
    """Writers' temp files: each as the store names it (to remove it) and as shown."""
    foreign: list[Stray]
    """Files that are not chunkstore's."""
    lone_records: list[tuple[StoredFile, Stray]] = field(default_factory=list)
    """Access records beside no chunk: each as the store names it and as shown."""


def find_strays(store: Store, shard: tuple[int, int] | None = None) -> FoundStrays:
    """The temp files and foreign files among the store's chunks, of shard ``(i, n)`` or
    all of them, in one walk (a store without stray files has none)."""
    if not isinstance(store, SupportsMaintenance):
        return FoundStrays([], [])
    found = store.strays(shard)
    return FoundStrays(
        [(f, _stray(store, f, "temp")) for f in found.unfinished],
        [_stray(store, f, "foreign") for f in found.foreign],
        [(f, _stray(store, f, "lone-record")) for f in found.lone_records],
    )


def remove_lone_records(store: Store, files: Sequence[StoredFile]) -> set[str]:
    """Delete these access records beside no chunk (as :func:`find_strays` found them), but
    for those whose chunk is there again; the store paths of those that went."""
    if not isinstance(store, SupportsLoneRecords) or not files:
        return set()
    return {f.path for f in store.remove_lone_records(files)}


def remove_unfinished(store: Store, files: Sequence[StoredFile]) -> int:
    """Delete these temp files (as :func:`find_strays` found them); how many went."""
    if not isinstance(store, SupportsMaintenance) or not files:
        return 0
    return int(store.remove_unfinished(files))


def _staged_stray(store: Store, item: StrandedFile) -> Stray:
    shown = store.relative_path(item.path) if isinstance(store, SupportsMaintenance) else item.path
    kind = "staged-quarantine" if item.into_quarantine else "staged-delete"
    return Stray(path=shown, size=item.size, mtime=item.staged, kind=kind)


def stranded_files(store: Store) -> list[Stray]:
    """Files a killed set-aside left staged (``mtime``: when staged, their ctime)."""
    if not isinstance(store, SupportsStagingSweep):
        return []
    return [_staged_stray(store, f) for f in store.stranded(0.0)]


def settle_stranded(store: Store, grace: float) -> list[Stray]:
    """Finish the set-asides staged more than ``grace`` seconds ago; the files settled."""
    if not isinstance(store, SupportsStagingSweep):
        return []
    return [_staged_stray(store, f) for f in store.settle_stranded(grace)]


def quarantined(store: Store) -> list[Stray]:
    """Chunks the store moved aside as corrupt."""
    if not isinstance(store, SupportsMaintenance):
        return []
    return [_stray(store, f, "quarantine") for f in store.quarantined()]


def stop_access_tracking(store: Store) -> None:
    """Make reads through ``store`` not count as uses (maintenance reads are not cache hits)."""
    if isinstance(store, SupportsMaintenance):
        store.track_access = False


def has_quarantine(store: Store) -> bool:
    """Whether the store moves corrupt chunks aside (otherwise :func:`quarantine` deletes)."""
    return isinstance(store, SupportsMaintenance) and store.quarantine_mode == "move"


def quarantine(store: Store, key: ChunkKey, reason: str) -> None:
    """Move a corrupt chunk aside (or delete it where the store has no quarantine area)."""
    if isinstance(store, SupportsMaintenance):
        store.quarantine(key, reason)
    else:
        store.delete_many([key])
