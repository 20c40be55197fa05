"""What maintenance tools need from a store beyond the serving interface.

``verify``, ``prune``, ``inspect`` and ``cp`` read without counting a use.
Otherwise ``prune --max-bytes`` would see every chunk as just used.
They move corrupt chunks aside, and report or sweep files that are not chunks.
Stores that keep such state implement :class:`SupportsMaintenance`.
That state is access records, a quarantine area, temp files or unfinished uploads.
The filesystem and S3 stores also implement :class:`SupportsCheckedRemoval`.
A tool then removes exactly the file it judged.
These are ``runtime_checkable`` protocols, not abstract methods.
So are the other ``Supports*`` capabilities in :mod:`chunkstore.backends.base`.
A store without them, such as memory or peers, has nothing to maintain.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from chunkstore.backends.base import Judgement, ReadVerdict
from chunkstore.hashing import ChunkKey

QUARANTINE_MODES = ("move", "delete")
"""What a store does with a corrupt chunk: move it to its quarantine area, or delete it."""

FileIdent = tuple[int, int] | str
"""Which file a read came from, for :class:`SupportsCheckedRemoval`.
For a local file it is (inode, mtime_ns).
For a file read through fsspec it is (size, digest of the bytes).
For an S3 object it is the ETag."""


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file in the store that is not a chunk: an orphan temp file or a foreign file."""

    path: str
    """Full path. It is the fsspec path for non-local stores, and the object key on S3."""
    namespace: str
    """Namespace directory it sits in ("" at the root)."""
    size: int
    """Bytes."""
    mtime: float
    """Last modification, seconds since the epoch."""


@dataclass(frozen=True, slots=True)
class Strays:
    """What one walk of a store's chunk directories (or of one shard of them) found that is
    not a chunk."""

    unfinished: list[StoredFile]
    """Interrupted writes: temp files, or S3's unfinished multipart uploads."""
    foreign: list[StoredFile]
    """Files chunkstore did not write."""
    lone_records: list[StoredFile] = field(default_factory=list)
    """Access records whose chunk is not there (filesystems): a victim's delete may leave
    one (spec 6.8)."""


@dataclass(frozen=True, slots=True)
class StrandedFile:
    """A set-aside's staged temp file, left by a process killed between its two renames.
    In ``quarantine/<ns>/`` it is a corrupt chunk on its way to its quarantine name.
    In the state directory it is a chunk being deleted."""

    path: str
    """Full path."""
    namespace: str
    """The quarantine namespace it sits in. "" in the state directory."""
    size: int
    """Bytes."""
    staged: float
    """When it was moved there (its ctime: a rename sets it), seconds since the epoch."""

    @property
    def into_quarantine(self) -> bool:
        """Whether a sweep finishes its move to quarantine (else it deletes the file)."""
        return bool(self.namespace)


STRANDED_NOTE = "stranded set-aside finished by a sweep (the first reason was lost)"
"""The ``.reason`` note of a chunk a sweep moved to its quarantine name."""


def reason_record(reason: str) -> bytes:
    """The note stored beside a quarantined chunk: when and why it was set aside."""
    return f"{time.time():.3f} {reason}\n".encode()


class SetAside(Enum):
    """What a store's set-aside of a corrupt chunk came to."""

    DONE = "done"
    """Moved to quarantine, or deleted (the store's ``quarantine_mode``)."""
    CHANGED = "left (replaced or removed since it was read)"
    """Left: another chunk, a writer's, is at its name now, or none as it was removed."""
    TAKEN = "left (already set aside by another run)"
    """Left: another run (a reader, ``verify``) moved this very chunk to quarantine first."""


def set_aside_outcome(result: SetAside, mode: str) -> str:
    """What became of a corrupt chunk a read found: the end of its log line.
    Either it was set aside the store's way, or it says why it was left.
    ``mode`` is the store's way, one of :data:`QUARANTINE_MODES`."""
    if result is not SetAside.DONE:
        return str(result.value)
    return "quarantined" if mode == "move" else "deleted"


@runtime_checkable
class SupportsMaintenance(Protocol):
    """Access records, a quarantine area and stray files (the filesystem and S3 stores)."""

    track_access: bool
    """Whether reads count as uses, in access records. Maintenance tools turn it off."""
    quarantine_mode: str
    """One of :data:`QUARANTINE_MODES`."""

    def quarantine(self, key: ChunkKey, reason: str) -> None:
        """Take a corrupt chunk out of the serving path (moved aside, or deleted)."""

    def quarantined(self) -> list[StoredFile]:
        """Chunks moved aside as corrupt."""

    def orphans(self, older_than: float = 0.0) -> list[StoredFile]:
        """Unfinished writes last touched at least ``older_than`` seconds ago."""

    def remove_orphans(self, grace: float = 3600.0) -> int:
        """Remove unfinished writes older than ``grace`` seconds. Returns how many went."""

    def remove_unfinished(self, files: Sequence[StoredFile]) -> int:
        """Remove these unfinished writes (as :meth:`strays` found them). Returns how many
        went."""

    def foreign_files(self) -> list[StoredFile]:
        """Files among the chunks that chunkstore did not write (reported, never touched)."""

    def strays(self, shard: tuple[int, int] | None = None) -> Strays:
        """Unfinished writes and foreign files among the chunks, of shard ``(i, n)`` (by the
        fan-out directory: see :func:`~chunkstore.backends._index.shard_of`) or of all."""

    def relative_path(self, path: str) -> str:
        """A :class:`StoredFile` path as shown to a user (relative to the store's root)."""


@runtime_checkable
class SupportsStagingSweep(Protocol):
    """Finish what a killed set-aside left staged (the filesystem store: its staged files
    sit outside the chunk directories, where the orphan sweep does not look)."""

    def stranded(self, older_than: float = 0.0) -> list[StrandedFile]:
        """Staged files moved there at least ``older_than`` seconds ago."""

    def settle_stranded(self, grace: float = 3600.0) -> list[StrandedFile]:
        """Settle the staged files older than ``grace`` seconds. Returns the files settled.

        Those in quarantine move to their quarantine name.
        They are deleted where a copy already holds it.
        Those in the state directory are deleted."""


@runtime_checkable
class SupportsLoneRecords(Protocol):
    """Delete access records whose chunk is gone (the filesystem store: a capped writer
    leaves the record of a victim the capacity index had no note of)."""

    def remove_lone_records(self, files: Sequence[StoredFile]) -> list[StoredFile]:
        """Delete these records (as :meth:`strays` found them), but for one whose chunk is
        there again (a writer stored it since). Returns those that went."""


@runtime_checkable
class SupportsCheckedRemoval(Protocol):
    """Set aside only the very file a tool read and judged, not one written since."""

    def read_unchecked_with_idents(
        self, keys: Sequence[ChunkKey]
    ) -> list[tuple[bytes, FileIdent | None] | None]:
        """Stored bytes per key (``None`` if gone), each with the ident of its file."""

    def quarantine_if_unchanged(self, key: ChunkKey, ident: FileIdent | None, reason: str) -> bool:
        """Quarantine ``key``'s chunk only if it is still the file ``ident`` names."""

    def delete_if_unchanged(self, key: ChunkKey, ident: FileIdent | None) -> bool:
        """Delete ``key``'s chunk only if it is still the file ``ident`` names."""


class _JudgingRemover(SupportsCheckedRemoval, Protocol):
    """A store that judges what it read and sets aside only the file judged."""

    quarantine_mode: str

    def _judge(self, key: ChunkKey, data: Any) -> Judgement: ...

    def _set_aside(
        self, key: ChunkKey, ident: FileIdent | None, reason: str | None
    ) -> SetAside: ...


def set_aside_if_still_corrupt(
    store: _JudgingRemover,
    key: ChunkKey,
    current: tuple[Any, FileIdent | None] | None,
    reason: str,
) -> str:
    """Set aside ``key``'s chunk as ``current`` shows it. Returns what became of it.

    ``current`` is its bytes and ident, read again now, or None if gone.
    This is for damage reported without saying which file was read.
    A writer may have published a good copy since.
    So only a copy judged corrupt now is set aside, and only that very one.
    The result is for the log, see :func:`set_aside_outcome`."""
    if current is None or store._judge(key, current[0]).verdict is not ReadVerdict.CORRUPT:
        return set_aside_outcome(SetAside.CHANGED, store.quarantine_mode)
    return set_aside_outcome(store._set_aside(key, current[1], reason), store.quarantine_mode)
