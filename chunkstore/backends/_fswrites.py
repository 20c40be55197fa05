"""The filesystem store's writes and removals: publish, delete, set aside, settle.

:class:`FsWrites` is a part of :class:`~chunkstore.backends._fs.FsStore`, mixed in.
It uses the store's own state; what it needs is declared at its top. Its
set-aside is the primitive :class:`~chunkstore.backends._upkeep.Upkeep` builds
quarantine on. The sweep of stranded set-asides is here too: only this store
stages them.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from chunkstore.backends import _layout as L
from chunkstore.backends._batching import (
    write_once_per_key,
)
from chunkstore.backends._capacity import CapacityLimiter
from chunkstore.backends._fastread import (
    DIRECT,
)
from chunkstore.backends._fsio import FsspecIO, LocalIO
from chunkstore.backends._index import CapacityIndex
from chunkstore.backends._iopool import IoPool
from chunkstore.backends.base import Buffer, Store
from chunkstore.backends.maintenance import (
    STRANDED_NOTE,
    FileIdent,
    SetAside,
    StrandedFile,
    reason_record,
)
from chunkstore.errors import StoreError
from chunkstore.format import chain_link
from chunkstore.hashing import ChunkKey, is_namespace

log = logging.getLogger(__name__)

_STAGING_REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EXDEV})
"""Errors of a rename into the state directory after which a delete stages beside the chunk."""


class FsWrites(Store):
    """Writes, deletes and set-asides of a filesystem store (mixed into FsStore)."""

    if TYPE_CHECKING:  # set by FsStore and FsReads
        io: LocalIO | FsspecIO
        root: str
        fsync: bool
        quarantine_mode: str
        write_mode: str
        _pool: IoPool
        _suspects: dict[ChunkKey, FileIdent | None]
        _touched: dict[ChunkKey, float]

        def path_of(self, key: ChunkKey) -> str: ...
        def _dir_of(self, key: ChunkKey) -> str: ...
        def _ensure_marker(self) -> None: ...
        def _refuse_link(self, *parts: str) -> None: ...
        def _limiter(self) -> CapacityLimiter | CapacityIndex | None: ...
        def read_unchecked_with_idents(
            self, keys: Sequence[ChunkKey]
        ) -> list[tuple[bytes, FileIdent | None] | None]: ...

    # --- writes ------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        """Store each chunk, several at a time.
        If any write fails, the others still end before the first failure is raised."""
        return self._put_batch(items, replace=True)

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._replacing_unusable(items, self._put_batch(items, replace=False))

    def _written_at(self, key: ChunkKey) -> float | None:
        try:
            st = self.io.stat(self.path_of(key))
        except OSError:
            return None
        return None if st is None else st.mtime

    def _put_batch(self, items: Sequence[tuple[ChunkKey, Buffer]], *, replace: bool) -> list[bool]:
        """Write ``items`` several at a time, with the results a loop over them would give."""
        return write_once_per_key(
            items,
            lambda unique: self._pool.map(lambda item: self._put(*item, replace=replace), unique),
            replace=replace,
        )

    def _put(self, key: ChunkKey, data: Buffer, *, replace: bool) -> bool:
        final = self.path_of(key)
        directory = self._dir_of(key)
        made = self.io.make_dir(directory)
        # A directory made just now held no chunk: no need to look for one.
        if not replace and not made and self.io.exists(final):
            return False
        view = memoryview(data).cast("B")
        tmp = None
        published = False
        limiter = self._limiter()
        reserved = None
        if isinstance(limiter, CapacityIndex):
            if not limiter.fits(len(view)):
                return False
            # The index makes the room while the temp file is written (no lock to wait on).
            reserved = limiter.reserve(final, len(view))
        try:
            self._ensure_marker()
            tmp = self._write_temp(key, view, directory)

            def publish() -> bool:
                nonlocal published
                if replace:
                    self.io.replace(tmp, final, self.fsync)
                    published = True
                    return True
                written = self.io.link_if_absent(tmp, final, self.fsync)
                published = True  # link_if_absent removed tmp either way
                return written

            if isinstance(limiter, CapacityIndex):
                admitting, reserved = reserved, None
                written = limiter.admit(
                    final,
                    len(view),
                    publish,
                    replace=replace,
                    reserved=admitting,
                    link=chain_link(view) or b"",
                )
            elif limiter is not None:
                written = limiter.admit(final, len(view), publish, replace=replace)
            else:
                written = publish()
            if written:
                # Note: an access record left from an earlier version needs no cleanup:
                # access time is max(mtime, record), and the record predates this write.
                self._touched.pop(key, None)
            return written
        except OSError as exc:
            raise StoreError(f"{self.name}: cannot write {final}: {exc}") from None
        finally:
            if tmp is not None and not published:
                with contextlib.suppress(OSError):
                    self.io.remove(tmp)
            if reserved is not None:  # the temp write failed before admit took it over
                assert isinstance(limiter, CapacityIndex)
                limiter.release(final, reserved)

    def _write_temp(self, key: ChunkKey, view: memoryview, directory: str) -> str:
        name = L.temp_name(key.hex)
        if isinstance(self.io, LocalIO):
            direct = self.write_mode == DIRECT
            return self.io.write_temp(directory, name, view, self.fsync, direct)
        return self.io.write_temp(directory, name, view, self.fsync)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        paths = [self.path_of(k) for k in keys]
        for k in keys:
            self._touched.pop(k, None)
        failures: list[tuple[str, OSError]] = []
        sizes: list[tuple[str, int]] = []

        def remove() -> list[tuple[str, int]]:
            # one path that may not be deleted (EACCES, EROFS) does not stop the others,
            # and the ledger counts exactly what went
            for path in paths:
                try:
                    size = self._remove_sized(path)
                except OSError as exc:
                    failures.append((path, exc))
                    continue
                if size >= 0:
                    sizes.append((path, size))
            return sizes

        limiter = self._limiter()
        if limiter is None:
            remove()
        else:
            limiter.removed(remove)
        count = len(sizes)
        if failures:
            path, exc = failures[0]
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            raise StoreError(
                f"{self.name}: cannot delete {path}{more}: {exc.strerror or exc}; "
                f"{count} other chunk(s) deleted"
            )
        return count

    def _remove_sized(self, path: str) -> int:
        """Delete one chunk (and its access record); its size, or -1 if it was not there."""
        st = self.io.stat(path)
        if st is None or not self.io.remove(path):
            return -1
        with contextlib.suppress(OSError):
            self.io.remove(path + ".atime")
        return st.size

    def _evict_path(self, path: str) -> int:
        size = self._remove_sized(path)
        return max(size, 0)

    def _evict_victim(self, path: str, chosen_at: float, recorded: bool) -> tuple[bool, int]:
        """Delete a chunk the capacity index chose as a victim at ``chosen_at`` (this
        machine's clock, no later than the choice), unless its file changed since.
        Its access record goes too when ``recorded`` (the index knows a reader wrote one)
        or through fsspec; a local record the index does not know of is left (harmless).

        Returns ``(deleted, kept)``: ``kept`` is the size of a file left in place because its
        ctime is past the choice (a put replaced it, or a read recorded a use), else 0.
        The index then accounts it again. Without a ctime (fsspec) the victim is deleted; the
        index was asked instead whether a writer stored it again.

        On a local filesystem a ctime is never later than the change it stamps, so no file
        changed before the choice is kept; a kernel may stamp it with a clock up to a tick
        behind, so a change within a tick after the choice may go unseen. Elsewhere the
        ctime is another machine's clock: skew keeps files that changed before, or misses a
        change just after; the index bounds how often it lets a victim stay
        (:data:`~chunkstore.backends._index.SPARE_WINDOW`). A use kept in an access record
        leaves the ctime alone and is not seen.
        """
        st = self.io.stat(path)
        if st is None:
            return False, 0
        if st.ctime > chosen_at:
            return False, st.size
        if not self.io.remove(path):
            return False, 0
        # (the record's unlink is skipped when the index knows of none: on a shared
        # filesystem an unlink of an absent name is a round trip to the metadata server)
        if recorded or not self.io.local:
            with contextlib.suppress(OSError):
                self.io.remove(path + ".atime")
        return True, 0

    # --- quarantine (the primitives of Upkeep) -------------------------------------

    def _suspect(self, key: ChunkKey) -> FileIdent | None:
        """Take the ident of ``key``'s file a read found corrupt (None: none recorded)."""
        return self._suspects.pop(key, None)

    def _read_current(self, key: ChunkKey) -> tuple[bytes, FileIdent | None] | None:
        return self.read_unchecked_with_idents([key])[0]

    def _set_aside(self, key: ChunkKey, ident: FileIdent | None, reason: str | None) -> SetAside:
        """Quarantine or delete the chunk file ``ident`` names. A given ``reason`` quarantines.

        The file is first renamed away, and only then compared with ``ident``.
        It goes to quarantine, or to a temp name in quarantine.
        When deleting, the temp name is in the state directory.
        A rename moves one inode, so what is checked is exactly what left the serving path.
        A file another writer published in between is put back.
        It is not when a yet newer one arrived.
        So nothing good is lost to the race.
        Through fsspec the comparison is of contents, read again on this rare path.
        A move there is only as atomic as the filesystem's ``mv``.
        """
        path = self.path_of(key)
        # The note kept beside a quarantined chunk; None: the chunk is deleted instead.
        note = None if reason is None or self.quarantine_mode == "delete" else reason_record(reason)
        delete = note is None
        done = False

        def remove() -> list[tuple[str, int]]:
            nonlocal done
            current = self.io.stat(path)
            if current is None:
                return []
            guarded = ident is not None
            if guarded and self.io.ident_at(path, current) != ident:
                return []
            if delete and not guarded:
                size = self._remove_sized(path)
                done = size >= 0
                return [(path, size)] if done else []
            aside = None
            if delete:
                self._refuse_link(L.STATE_DIR)
                staging = self.io.join(self.root, L.STATE_DIR)
            else:
                self._refuse_link(L.QUARANTINE_DIR, key.namespace)
                staging = self.io.join(self.root, L.QUARANTINE_DIR, key.namespace)
                aside = self.io.join(staging, key.hex + L.CHUNK_SUFFIX)
            # Staged in a directory of the store's own, never beside the chunk: there a temp
            # name is an orphan to the sweep of a concurrent prune/verify, and the staged
            # file keeps the chunk's old mtime, so any grace would let the sweep delete the
            # evidence on its way to quarantine, or a good rewrite on its way back.
            staged = self.io.join(staging, L.temp_name(key.hex))
            # A guarded move goes by way of the temp name staged: moved straight to
            # quarantine, a file then found to be another than the one judged would go back
            # to its name, and a copy quarantine held would be gone with it (asking whether
            # quarantine is free first does not help: another verify run may set the same
            # key aside between the question and the move).
            dest = staged if aside is None or guarded else aside
            try:
                if not self.io.move(path, dest):
                    return []
            except OSError as exc:
                if not delete or exc.errno not in _STAGING_REFUSED:
                    raise
                # The state directory is another user's on a shared mount, read-only or on
                # another filesystem: a delete stages beside the chunk, as it did before it
                # staged there (a sweep at that moment could then take a good rewrite).
                dest = self.io.join(self._dir_of(key), L.temp_name(key.hex))
                if not self.io.move(path, dest):
                    return []
            taken = (self.io.stat(dest) if guarded else None) or current
            moved = self.io.ident_at(dest, taken) if guarded else ident
            if moved is not None and moved != ident:
                restored = self.io.link_if_absent(dest, path, self.fsync)  # removes dest
                return [] if restored else [(path, taken.size)]
            done = True
            if aside is not None and dest != aside:
                if not self.io.move(dest, aside):
                    log.warning("%s: %s set aside, left as %s", self.name, path, dest)
                    return [(path, taken.size)]
                dest = aside
            with contextlib.suppress(OSError):
                self.io.remove(path + ".atime")
            with contextlib.suppress(OSError):
                if note is None:
                    self.io.remove(dest)
                else:
                    self.io.write_small(dest + L.REASON_SUFFIX, note)
            return [(path, taken.size)]

        self._touched.pop(key, None)
        limiter = self._limiter()
        try:
            if limiter is not None:
                limiter.removed(remove)
            else:
                remove()
        except OSError as exc:
            raise StoreError(f"{self.name}: cannot set aside {path}: {exc}") from None
        # (a file gone from its name is CHANGED here even where another run set it aside:
        # only the S3 store looks in quarantine to tell the two apart)
        return SetAside.DONE if done else SetAside.CHANGED

    # --- stranded set-asides (SupportsStagingSweep) --------------------------------

    def _staging_places(self) -> Iterator[tuple[str, str]]:
        """(namespace, directory) where ``_set_aside`` stages: ``quarantine/<ns>/`` ("" for
        the state directory). Only real directories: through a link, a sweep would move or
        delete someone else's files."""
        qdir = self.io.join(self.root, L.QUARANTINE_DIR)
        if not self.io.is_link(qdir):
            for ns, is_dir in sorted(self.io.listdir(qdir) or []):
                if is_dir and is_namespace(ns):
                    yield ns, self.io.join(qdir, ns)
        state = self.io.join(self.root, L.STATE_DIR)
        if not self.io.is_link(state):
            yield "", state

    def _staged(self, older_than: float) -> Iterator[tuple[str, str, StrandedFile]]:
        # Age by the ctime: the staged file keeps the chunk's old mtime (an mtime grace would
        # take a set-aside in progress at once); the rename that staged it set the ctime. A
        # filesystem without one (fsspec: 0) lists none.
        cutoff = time.time() - older_than
        for ns, directory in self._staging_places():
            for name, st in self.io.scan_files(directory):
                hex_digest = L.staged_hex(name)
                if hex_digest is None or not st.regular or not 0 < st.ctime <= cutoff:
                    continue
                path = self.io.join(directory, name)
                yield directory, hex_digest, StrandedFile(path, ns, st.size, st.ctime)

    def stranded(self, older_than: float = 0.0) -> builtins.list[StrandedFile]:
        """Files a set-aside staged at least ``older_than`` seconds ago.
        They are named ``quarantine/<ns>/.<hex>.<pid>.<rand>.tmp``, or the same in the state
        directory.
        A process killed between its two renames left them.
        None through fsspec, which has no ctime to tell their age by."""
        return [f for _, _, f in self._staged(older_than)]

    def settle_stranded(self, grace: float = 3600.0) -> builtins.list[StrandedFile]:
        """Finish the set-asides staged more than ``grace`` seconds ago. Returns the files settled.

        A chunk in quarantine gets its quarantine name, the evidence.
        It is deleted where a copy already holds that name: quarantine keeps one per key.
        One in the state directory was being deleted, and is deleted."""
        settled = []
        for directory, hex_digest, f in self._staged(grace):
            try:
                if f.into_quarantine:
                    aside = self.io.join(directory, hex_digest + L.CHUNK_SUFFIX)
                    if self.io.link_if_absent(f.path, aside, self.fsync):  # removes f.path
                        self.io.write_small(aside + L.REASON_SUFFIX, reason_record(STRANDED_NOTE))
                elif not self.io.remove(f.path):
                    continue  # gone meanwhile (another sweep)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("%s: cannot settle the staged %s: %s", self.name, f.path, exc)
                continue
            settled.append(f)
        return settled
