"""Store maintenance written once: quarantine, orphans, model records and the capacity index.

The filesystem and S3 stores both mix in :class:`Upkeep`. It holds what the two do
alike. Each store gives it a few primitives, named in the class's docstring. What
differs is only how a backend moves, lists and reads its files.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from chunkstore.backends import _layout as L
from chunkstore.backends._index import CapacityIndex, chunks_of_shard, open_index
from chunkstore.backends.maintenance import (
    FileIdent,
    SetAside,
    StoredFile,
    Strays,
    set_aside_if_still_corrupt,
    set_aside_outcome,
)
from chunkstore.errors import StoreError
from chunkstore.hashing import ChunkKey

if TYPE_CHECKING:
    from chunkstore.backends.base import ChunkInfo, Judgement

log = logging.getLogger(__name__)


class Upkeep:
    """Maintenance over a backend's primitives (:class:`SupportsMaintenance` and more).

    A store that mixes this in provides:

    * ``_set_aside(key, ident, reason)``: quarantine or delete one chunk file.
      It acts only if the file is still ``ident`` (any file when None).
    * ``_suspect(key)``: take the ident a read recorded for a corrupt chunk.
      None where the store records none.
    * ``_read_current(key)``: the chunk's bytes and ident, read again now.
    * ``_area_files(area)``: (name under ``area``, path, size, mtime) per file there.
    * ``_unfinished(shard)`` and ``_drop_unfinished(file)``: interrupted writes;
      ``_foreign(shard)``: files among the chunks chunkstore did not write.
    * ``_read_small(name)`` and ``_write_small(name, data)``: a small file.
      Names are relative to the root. Both raise OSError on failure.
    * ``_full_path(name)``, ``_name_of(path)``, ``_chunk_path(key)``: naming.
    * ``_evict_victim(path, chosen_at, recorded)`` and ``_exists_path(path)``: for the
      capacity index, with ``_has_ctime``: whether its files show when they last changed.
    * ``_ensure_marker()`` and ``list()``, as the store has them anyway.
    """

    if TYPE_CHECKING:
        name: str
        quarantine_mode: str

        @property
        def _has_ctime(self) -> bool: ...

        def _set_aside(
            self, key: ChunkKey, ident: FileIdent | None, reason: str | None
        ) -> SetAside: ...
        def _judge(self, key: ChunkKey, data: Any) -> Judgement: ...
        def read_unchecked_with_idents(
            self, keys: Sequence[ChunkKey]
        ) -> builtins.list[tuple[bytes, FileIdent | None] | None]: ...
        def _suspect(self, key: ChunkKey) -> FileIdent | None: ...
        def _read_current(self, key: ChunkKey) -> tuple[Any, FileIdent | None] | None: ...
        def _area_files(self, area: str) -> Iterable[tuple[str, str, int, float]]: ...
        def _unfinished(self, shard: tuple[int, int] | None = None) -> Iterable[StoredFile]: ...
        def _foreign(self, shard: tuple[int, int] | None = None) -> Iterable[StoredFile]: ...
        def _drop_unfinished(self, orphan: StoredFile) -> bool: ...
        def _read_small(self, name: str) -> bytes | None: ...
        def _write_small(self, name: str, data: bytes) -> None: ...
        def _full_path(self, name: str) -> str: ...
        def _name_of(self, path: str) -> str: ...
        def _chunk_path(self, key: ChunkKey) -> str: ...
        def _evict_victim(
            self, path: str, chosen_at: float, recorded: bool
        ) -> tuple[bool, int]: ...
        def _exists_path(self, path: str) -> bool: ...
        def _ensure_marker(self) -> None: ...
        def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]: ...

    # --- quarantine (SupportsMaintenance, SupportsCheckedRemoval) -----------------

    def quarantine(self, key: ChunkKey, reason: str) -> None:
        """Move ``key``'s chunk to quarantine, or delete it (``quarantine="delete"``).

        This is a maintenance tool's verdict, on whatever file is there now.
        :meth:`quarantine_if_unchanged` sets aside only the file that was read.
        Raises StoreError where the set-aside failed.
        """
        self._suspect(key)  # the tool's verdict replaces what a read recorded
        self._set_aside(key, None, reason)

    def _quarantine(self, key: ChunkKey, reason: str) -> str:
        # The ident of the file a read found bad: a good rewrite since is left alone.
        ident = self._suspect(key)
        if ident is None:
            # Which file the read saw is not known here (a caller that checks what it read,
            # or a store that keeps no idents), and a writer may have published a good copy
            # since. Judge what is there now (a second read, on this rare path) and set
            # aside only that one.
            return set_aside_if_still_corrupt(self, key, self._read_current(key), reason)
        return set_aside_outcome(self._set_aside(key, ident, reason), self.quarantine_mode)

    def quarantine_if_unchanged(self, key: ChunkKey, ident: FileIdent | None, reason: str) -> bool:
        """Quarantine ``key``'s chunk only if it is still the file ``ident`` names.

        The ident comes from ``read_unchecked_with_idents``. None: whatever is there.
        True if it was set aside. Raises StoreError where the set-aside failed.
        """
        return self._set_aside(key, ident, reason) is SetAside.DONE

    def delete_if_unchanged(self, key: ChunkKey, ident: FileIdent | None) -> bool:
        """Delete ``key``'s chunk only if it is still the file ``ident`` names.

        True if deleted. Raises StoreError where the delete failed.
        """
        return self._set_aside(key, ident, None) is SetAside.DONE

    def quarantined(self) -> builtins.list[StoredFile]:
        """Chunks moved aside as corrupt (reason notes and staged files are not)."""
        return [
            StoredFile(path, rel.split("/", 1)[0], size, mtime)
            for rel, path, size, mtime in self._area_files(L.QUARANTINE_DIR)
            if rel.endswith(L.CHUNK_SUFFIX)
        ]

    # --- interrupted writes -------------------------------------------------------

    def orphans(self, older_than: float = 0.0) -> builtins.list[StoredFile]:
        """Interrupted writes last touched at least ``older_than`` seconds ago."""
        cutoff = time.time() - older_than
        return [f for f in self._unfinished() if f.mtime <= cutoff]

    def remove_orphans(self, grace: float = 3600.0) -> int:
        """Remove interrupted writes older than ``grace`` seconds; how many went.

        Live writers finish far sooner than the default hour.
        """
        return self.remove_unfinished(self.orphans(grace))

    def remove_unfinished(self, files: Sequence[StoredFile]) -> int:
        """Remove these interrupted writes (found by :meth:`strays` or :meth:`orphans`);
        how many went."""
        return sum(1 for f in files if self._drop_unfinished(f))

    def foreign_files(self) -> builtins.list[StoredFile]:
        """Files among the chunks that are neither chunks, access records nor temp files."""
        return builtins.list(self._foreign())

    def strays(self, shard: tuple[int, int] | None = None) -> Strays:
        """Interrupted writes and foreign files (of shard ``(i, n)``)."""
        return Strays(builtins.list(self._unfinished(shard)), builtins.list(self._foreign(shard)))

    # --- model records (SupportsModelRecords) -------------------------------------

    def read_model_record(self, fingerprint: bytes) -> bytes | None:
        """The record of the model with ``fingerprint`` (:mod:`._models`), or None.

        An unreadable record is None too, and logged. A record is a hint only:
        the model then shows as unknown.
        """
        name = L.model_record_name(fingerprint)
        try:
            return self._read_small(name)
        except OSError as exc:  # a directory, FIFO or unreadable file at the record's name
            log.warning(
                "%s: cannot read the model record %s: %s", self.name, self._full_path(name), exc
            )
            return None

    def write_model_record(self, fingerprint: bytes, record: bytes) -> None:
        """Store the record of the model with ``fingerprint``, replacing it whole.

        Raises StoreError on failure.
        """
        self._ensure_marker()
        try:
            self._write_small(L.model_record_name(fingerprint), record)
        except OSError as exc:
            raise StoreError(f"{self.name}: cannot write a model record: {exc}") from None

    # --- capacity index -------------------------------------------------------------

    def _open_index(self, index: Any, max_bytes: int | None) -> CapacityIndex:
        """The capacity index named by ``index``, keyed by this store's identity.

        The identity is a hash of the layout marker. Every mount of one volume
        reads it alike, and so does every client of one bucket.
        """
        self._ensure_marker()
        try:
            marker = self._read_small(L.MARKER_NAME)
        except OSError as exc:
            raise StoreError(f"{self.name}: cannot read the layout marker: {exc}") from None
        return open_index(
            index,
            marker,
            max_bytes,
            name_of=self._name_of,
            path_of=self._full_path,
            evict=self._evict_victim,
            evict_many=getattr(self, "_evict_paths", None),
            scan=self._scan_records,
            exists=self._exists_path,
            label=self.name,
            ask_back=not self._has_ctime,
        )

    def _scan_shard(self, shard: tuple[int, int] | None) -> Iterator[tuple[str, int, float]]:
        """(path, size, access time) of every chunk, or of one shard ``(i, n)``."""
        chunks = self.list() if shard is None else chunks_of_shard(self, shard)
        for info in chunks:
            yield self._chunk_path(info.key), info.size, info.atime

    def _scan_records(
        self, shard: tuple[int, int] | None
    ) -> Iterator[tuple[str, int, float, bool]]:
        """:meth:`_scan_shard`, each chunk with whether an access record lies beside it.
        Here always False: a store that deletes every victim's record needs no flag."""
        for path, size, atime in self._scan_shard(shard):
            yield path, size, atime, False
