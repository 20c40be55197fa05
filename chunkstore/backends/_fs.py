"""The filesystem store: a directory tree (local, NFS/Lustre mount, or any fsspec URL).

Layout (spec/FORMAT.md, "Store layout"; names in :mod:`chunkstore.backends._layout`)::

    <root>/chunkstore-layout.json
    <root>/<namespace>/ab/cd/<hex>.kvc

Nothing is kept only in memory: a fresh process sees every chunk on disk.
Writes go to a unique temp file in the chunk's directory and are renamed (or,
for ``put_if_absent``, hard-linked) into place, so readers see whole chunks
only and a killed writer leaves at most an orphan temp file.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from chunkstore.backends import _layout as L
from chunkstore.backends._batching import (
    buffer_too_small,
    first_copies,
    read_once_per_key,
    writable_view,
    write_once_per_key,
)
from chunkstore.backends._capacity import CapacityLimiter, Usage
from chunkstore.backends._fastread import (
    AUTO,
    BUFFERED,
    DIRECT,
    READ_MODES,
    ChunkFileReader,
    Undecided,
    VerifiedRead,
    read_into,
    through_page_cache,
)
from chunkstore.backends._fsio import FileStat, FsspecIO, LocalIO
from chunkstore.backends._index import CapacityIndex
from chunkstore.backends._iopool import IoPool, raise_first
from chunkstore.backends._upkeep import Upkeep
from chunkstore.backends.base import (
    UNSUPPORTED_GRACE,
    Buffer,
    ChunkInfo,
    Judgement,
    ReadVerdict,
    Store,
    judge_oversized,
)
from chunkstore.backends.maintenance import (
    QUARANTINE_MODES,
    STRANDED_NOTE,
    FileIdent,
    SetAside,
    StoredFile,
    StrandedFile,
    reason_record,
)
from chunkstore.errors import (
    ConfigError,
    FormatError,
    MissingDependency,
    StoreError,
)
from chunkstore.format import (
    MAX_HEADER_BYTES,
    ByteRange,
    header_bytes_needed,
)
from chunkstore.hashing import ChunkKey, check_namespace, is_namespace
from chunkstore.units import parse_size

log = logging.getLogger(__name__)
_STAGING_REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.EXDEV})
"""Errors of a rename into the state directory after which a delete stages beside the chunk."""

_TOUCH_MEMO_LIMIT = 65536


@dataclass(frozen=True, slots=True)
class FsIoStats:
    """How a filesystem store moves bytes, and what its reads did so far."""

    requested: str
    """``read_mode`` as configured (``auto``, ``direct`` or ``buffered``)."""
    mode: str
    """``read_mode`` in effect: ``buffered`` where the filesystem refused O_DIRECT
    (or for non-local fsspec filesystems)."""
    write_mode: str
    """``write_mode`` in effect (``direct`` or ``buffered``)."""
    workers: int
    """Threads a batched call keeps busy (1: the caller's thread only)."""
    direct_reads: int
    """Chunk reads that bypassed the page cache (O_DIRECT) for some or all of their bytes."""
    cached_reads: int
    """Chunk reads served through the page cache only, from files it held (or ``buffered``)."""
    cold_reads: int
    """Chunk reads (``auto``) of files the page cache did not hold: through it with
    sequential readahead, the file's pages dropped after."""


class FsStore(Upkeep, Store):
    """Chunks as files under ``root``: local paths through ``os``, anything else through fsspec.

    Options:
        create: make the root (and its layout marker) if missing; otherwise a
            missing root is a :class:`StoreError`. A non-empty directory that is
            not a chunkstore store is always refused.
        fsync: fsync each chunk and its directory before it becomes visible.
        quarantine: ``"move"`` corrupt chunks to ``<root>/quarantine/`` or ``"delete"`` them.
        max_bytes: cap on chunk bytes; least recently used chunks are evicted. Held across
            writer processes on local and kernel-mounted paths (flock); through fsspec only
            within one process (a warning is logged at open). With ``index``, held by the
            index for every writer of the cluster, with no lock.
        index: a capacity index for a store shared by many machines: a Redis or Valkey URL
            (``redis://host:6379/0``) or a client. Usage and LRU order live there; publishes
            take no lock (:mod:`chunkstore.backends._index`, spec section 6.8).
        track_access: record reads as access times (off for tools like ``verify``).
        access_resolution: seconds; an access is recorded at most this often per chunk.
        io_workers: threads that keep several chunk reads/writes of one batched call
            (``get_many``, ``get_many_into``, ``put_many``) in flight: the caller's and up to
            ``io_workers - 1`` of the store's own (started on first use, stopped by
            :meth:`close`); 1 runs everything on the caller's thread.
        read_mode: how reads into page-aligned buffers (host-cache slots) bring bytes in:
            ``"auto"`` (the page cache; a chunk it did not hold is read around it with
            O_DIRECT, or, over ``READAHEAD_FROM`` into memory not on huge pages, with
            sequential readahead and dropped from it after: see
            :mod:`chunkstore.backends._fastread`), ``"direct"`` (always O_DIRECT) or
            ``"buffered"``. Where the
            filesystem refuses O_DIRECT the store reads ``buffered`` (logged once, and
            shown by :meth:`io_stats` and ``repr``). Other buffers are always read buffered.
        write_mode: ``"buffered"`` writes through the page cache (fastest in bursts while
            dirty pages may accumulate); ``"direct"`` writes the whole pages of a page-aligned
            chunk (a host-cache slot) around it, straight from that memory, at a quarter of
            the CPU per chunk but at the device's pace (the last partial page, any other
            buffer, and filesystems refusing O_DIRECT still go through the page cache).
    """

    kind = "fs"
    unsupported_grace: float | None = UNSUPPORTED_GRACE

    def __init__(
        self,
        root: str,
        *,
        fs: Any = None,
        create: bool = False,
        fsync: bool = False,
        quarantine: str = "move",
        max_bytes: int | str | None = None,
        track_access: bool = True,
        access_resolution: float = 60.0,
        verify: bool = True,
        name: str | None = None,
        io_workers: int = 4,
        read_mode: str = AUTO,
        write_mode: str = BUFFERED,
        index: Any = None,
    ) -> None:
        super().__init__(name=name, verify=verify)
        if read_mode not in READ_MODES:
            raise ConfigError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
        if write_mode not in (BUFFERED, DIRECT):
            raise ConfigError(f"write_mode must be 'buffered' or 'direct', got {write_mode!r}")
        if quarantine not in QUARANTINE_MODES:
            raise ConfigError(f"quarantine must be one of {QUARANTINE_MODES}, got {quarantine!r}")
        if access_resolution < 0:
            raise ConfigError("access_resolution must not be negative")
        self.io: LocalIO | FsspecIO
        if fs is None or _is_local_fs(fs):
            self.io = LocalIO()
            self.root = os.path.abspath(os.path.expanduser(root))
        else:
            self.io = FsspecIO(fs)
            self.root = root.rstrip("/") or "/"
        self.fsync = fsync
        self.quarantine_mode = quarantine
        self.track_access = track_access
        self.access_resolution = float(access_resolution)
        self._touched: dict[ChunkKey, float] = {}
        self._suspects: dict[ChunkKey, FileIdent | None] = {}
        self.read_errors = 0
        """Reads that failed with an OS error other than absence (EIO, ESTALE, EACCES, a
        directory at a chunk's path): each was logged and served as a miss."""
        self._marker_ok = False
        self._marker_lock = threading.Lock()
        self._prefix = self.io.join(self.root, "x")[:-1]  # the root with one separator after it
        self.requested_read_mode = read_mode
        self.read_mode = read_mode if isinstance(self.io, LocalIO) else BUFFERED
        self.write_mode = write_mode if isinstance(self.io, LocalIO) else BUFFERED
        self._direct_reads = 0
        self._cached_reads = 0
        self._cold_reads = 0
        self._pool = IoPool(io_workers, self.name)
        self._open_root(create)
        for own in (L.STATE_DIR, L.QUARANTINE_DIR):
            self._refuse_link(own)
        self.capacity: CapacityLimiter | CapacityIndex | None = None
        self.index: CapacityIndex | None = None
        limiter = CapacityLimiter(
            self.io,
            self.io.join(self.root, L.STATE_DIR),
            None if max_bytes is None else parse_size(max_bytes),
            scan=lambda: self._scan_shard(None),
            probe=self._probe,
            evict=self._evict_path,
        )
        # Without a cap: the ledger-only limiter, used while a capped writer's ledger exists.
        self._ledger_keeper = limiter
        if index is not None:
            self.index = self._open_index(index, limiter.max_bytes)
            self.capacity = self.index
        elif max_bytes is not None:
            self.capacity = limiter
            if isinstance(self.io, FsspecIO):
                # fsspec has no cross-process lock: the ledger update is atomic per process only
                log.warning(
                    "%s: max_bytes on a non-local filesystem (%s) holds per writer process: "
                    "several processes writing to %s together can exceed it; use one writer "
                    "process, or a local/kernel-mounted path (flock)",
                    self.name,
                    type(self.io.fs).__name__,
                    self.root,
                )

    # --- opening -----------------------------------------------------------------

    def _name_of(self, path: str) -> str:
        """``path`` relative to the root, with ``/``: the chunk's name in the index."""
        return path[len(self._prefix) :].replace(os.sep, "/")

    def _full_path(self, name: str) -> str:
        """The full path of ``name`` (relative to the root, with ``/``)."""
        return self.io.join(self.root, *name.split("/"))

    def _exists_path(self, path: str) -> bool:
        return self.io.stat(path) is not None

    def _open_root(self, create: bool) -> None:
        where = self.root
        try:
            kind = self.io.kind(self.root)
            if kind == "missing":
                if not create:
                    raise StoreError(
                        f"{where}: no such directory (pass create=True to make a store)"
                    )
                self.io.makedirs(self.root)
                self._ensure_marker()
                return
            if kind == "file":
                raise StoreError(f"{where}: is a file, not a chunkstore directory")
            marker = self.io.read_small(self.io.join(self.root, L.MARKER_NAME))
            if marker is not None:
                L.check_marker(marker, where)
                self._marker_ok = True
                return
            entries = self.io.listdir(self.root)
            if entries is None:
                raise StoreError(f"{where}: cannot list the directory")
            if any(n == L.MARKER_NAME for n, _ in entries):
                # A concurrent creator renamed its marker into place after our first look.
                marker = self.io.read_small(self.io.join(self.root, L.MARKER_NAME))
                if marker is not None:
                    L.check_marker(marker, where)
                    self._marker_ok = True
                    return
            # a concurrent creator's marker temp file is ours too (seen between write and rename)
            names = {n for n, _ in entries if L.classify(n) != L.TEMP}
            ours = {
                n
                for n, is_dir in entries
                if is_dir and (is_namespace(n) or n in (L.QUARANTINE_DIR, L.STATE_DIR))
            }
            if names and not ours:
                raise StoreError(
                    f"{where}: not a chunkstore directory (no {L.MARKER_NAME} and no chunk "
                    "directories, but other files); use an empty or new directory"
                )
            if create:
                self._ensure_marker()
        except PermissionError as exc:
            raise StoreError(f"{where}: permission denied ({exc.strerror})") from None
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"{where}: cannot open store: {exc}") from None

    def _refuse_link(self, *parts: str) -> None:
        """StoreError if ``root/parts[0]`` (or a deeper prefix of ``parts``) is a symbolic
        link: the store writes its own files (quarantined chunks, ledger, model records)
        only into real directories of its own, never through a link to elsewhere, where a
        move or an atomic replace would overwrite someone's file of the same name."""
        path = self.root
        for part in parts:
            path = self.io.join(path, part)
            if self.io.is_link(path):
                raise StoreError(
                    f"{path} is a symbolic link: a store's own directories must be real "
                    "(what it writes there would land outside the store); remove the link"
                )

    def _ensure_marker(self) -> None:
        """Write the layout marker before the first chunk (an empty root may lack it)."""
        if self._marker_ok:
            return
        with self._marker_lock:
            path = self.io.join(self.root, L.MARKER_NAME)
            existing = self.io.read_small(path)
            if existing is None:
                # Note: published only if still absent, never replacing the marker another
                # creator wrote meanwhile: on a shared mount (JuiceFS) a file replaced through
                # another node vanishes under a reader's open descriptor (ENOENT, EBADF), and
                # that node could not open the store.
                tmp = self.io.write_temp(
                    self.root, L.temp_name(L.MARKER_NAME), L.marker_bytes(), False
                )
                if not self.io.link_if_absent(tmp, path, False):
                    existing = self.io.read_small(path)
            if existing is not None:
                L.check_marker(existing, self.root)
            self._marker_ok = True

    # --- paths -------------------------------------------------------------------

    def _chunk_path(self, key: ChunkKey) -> str:
        return self.path_of(key)

    def path_of(self, key: ChunkKey) -> str:
        """Where ``key``'s chunk file lives."""
        # Note: an f-string, not io.join: this runs once per key of every lookup (a third of
        # an exists check's time went to os.path.join); namespace and hex hold no separators.
        h = key.hex
        sep = self.io.sep
        return f"{self._prefix}{key.namespace}{sep}{h[0:2]}{sep}{h[2:4]}{sep}{h}{L.CHUNK_SUFFIX}"

    def _dir_of(self, key: ChunkKey) -> str:
        h = key.hex
        return self.io.join(self.root, key.namespace, h[0:2], h[2:4])

    # --- reads -------------------------------------------------------------------

    def _read_whole(self, path: str) -> tuple[bytes, FileStat] | None:
        """The file and its stat; None if missing or unreadable (logged, counted)."""
        try:
            return self.io.read(path)
        except OSError as exc:
            self._read_failed(path, exc)
            return None

    def _read_failed(self, path: str, exc: OSError) -> None:
        # Note: EIO/ESTALE on a shared mount, or another user's unreadable file, must not
        # reach the serving path as an exception (the contract is: a miss).
        with self._corrupt_lock:
            self.read_errors += 1
        log.warning("%s: cannot read %s, treated as a miss: %s", self.name, path, exc)

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        return [None if got is None else got[0] for got in self._read_versions(keys)]

    def _read_versions(self, keys: Sequence[ChunkKey]) -> list[tuple[bytes, FileStat] | None]:
        return [self._read_whole(self.path_of(key)) for key in keys]

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Stored bytes per key, unvalidated, not recorded as an access (for verify/cp)."""
        return self._read_many(keys)

    def read_unchecked_with_idents(
        self, keys: Sequence[ChunkKey]
    ) -> list[tuple[bytes, FileIdent | None] | None]:
        """Like :meth:`read_unchecked_many`, with an ident of the file each read came from.

        Hand the ident to :meth:`quarantine_if_unchanged` / :meth:`delete_if_unchanged`
        so that a maintenance tool removes the file it judged, never one another writer
        put in its place since: the inode on local paths, the content through fsspec.
        """
        return [
            None if got is None else (got[0], self.io.ident_of_read(*got))
            for got in self._read_versions(keys)
        ]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Chunk bytes per key; ``None`` for missing and corrupt (quarantined) chunks.

        On local paths with verification the result is a ``bytearray`` (read and
        checksummed in one pass, no extra copy); otherwise ``bytes``. Several chunks
        are read at a time (``io_workers``).
        """
        # Each key once (a corrupt chunk asked for twice is counted and set aside once);
        # a later copy of a key gets a buffer of its own (bytes are shared: immutable).
        first = first_copies(keys)
        if len(first) == len(keys):
            return self._pool.map(self._get_one, keys)
        got = dict(zip(first, self._pool.map(self._get_one, list(first))))
        copies: list[Any] = [
            bytearray(got[key]) if first[key] != i and isinstance(got[key], bytearray) else got[key]
            for i, key in enumerate(keys)
        ]
        return copies

    def _get_one(self, key: ChunkKey) -> Any:
        path = self.path_of(key)
        if isinstance(self.io, LocalIO) and self.verify:
            got = self._read_local(key, path, None)
            return None if got is None else got[0]
        whole = self._read_whole(path)
        if whole is None:
            return None
        data, st = whole
        if self.verify and not self._valid(key, data, st):
            return None
        self._touch(key, path, st)
        return data

    def _read_local(
        self, key: ChunkKey, path: str, buffer: memoryview | None
    ) -> tuple[Any, int] | None:
        """Read (and, if verifying, check in the same pass) a local chunk into ``buffer``
        or a new bytearray; (buffer, size), or None if missing or corrupt."""
        pending = self._start_local(key, path, buffer)
        if pending is None:
            return None
        try:
            return self._finish_local(pending)
        finally:
            self._close_unended([pending])

    def _start_local(
        self, key: ChunkKey, path: str, buffer: memoryview | None
    ) -> _LocalRead | None:
        """First step of a local read: open the file, choose how bytes come in and, if
        verifying, read and check the header; None if missing or corrupt.

        Into a caller's buffer, bytes come in as ``read_mode`` says (the whole buffer is
        handed to the reader: room past the chunk's end lets an O_DIRECT read take its
        last block whole). A verified read through the page cache takes the chunk's size
        from its header, with no ``fstat`` (:class:`VerifiedRead` ``sized=False``); where
        that read cannot vouch for the file, it is read again with its ``fstat``, which
        judges it as before. The open file belongs to the returned read until
        :meth:`_finish_local` ends it."""
        assert isinstance(self.io, LocalIO)
        try:
            fd = self.io.open_fd(path)
        except OSError as exc:
            self._read_failed(path, exc)
            return None
        if fd is None:
            return None
        reader: ChunkFileReader | None = None
        st: FileStat | None = None
        try:
            if buffer is not None:
                reader = ChunkFileReader(fd, buffer, self.read_mode)
                if self.verify and not reader.direct:
                    try:
                        quick = VerifiedRead(
                            fd,
                            buffer,
                            key.digest,
                            reader=reader,
                            sized=False,
                            expected_namespace=key.namespace,
                        )
                    except Undecided:
                        pass  # judged below, with the file's size
                    else:
                        return _LocalRead(key, path, fd, None, buffer, quick.target, reader, quick)
            st = self.io.stat_fd(fd, path)
            out, view = self._sized_view(fd, st, buffer, key)
            if reader is None:
                reader = ChunkFileReader(fd, view)
            check = (
                VerifiedRead(fd, view, key.digest, reader=reader, expected_namespace=key.namespace)
                if self.verify
                else None
            )
            return _LocalRead(key, path, fd, st, out, view, reader, check)
        except FormatError as exc:
            self._end_local(fd, reader)
            assert st is not None  # (only a sized read raises a format error)
            self._admit_read(key, Judgement.of(exc), st)  # never OK: a miss
            return None
        except OSError as exc:
            self._end_local(fd, reader)
            self._read_failed(path, exc)
            return None
        except BaseException:
            self._end_local(fd, reader)
            raise

    def _finish_local(self, read: _LocalRead) -> tuple[Any, int] | None:
        """Second step: bring in (and check) the payload, end the read; (buffer, size) or
        None. Nothing of ``read.out`` counts as loaded unless this returns it."""
        try:
            if read.check is not None:
                try:
                    try:
                        read.check.finish()
                    except Undecided:
                        self._reread_sized(read)
                except FormatError as exc:
                    assert read.st is not None  # (only a sized read raises a format error)
                    self._admit_read(read.key, Judgement.of(exc), read.st)  # never OK: a miss
                    return None
            elif read.reader.read(0, len(read.view)) < len(read.view):
                return None  # published files never shrink; treat as gone
            # (before the file is closed: the access record may need its fstat)
            self._touch(read.key, read.path, read.st, read.fd)
        except OSError as exc:
            self._read_failed(read.path, exc)
            return None
        finally:
            read.ended = True  # (marked first: a close must never run twice on one fd number)
            self._end_local(read.fd, read.reader)
        return read.out, len(read.view)

    def _reread_sized(self, read: _LocalRead) -> None:
        """Read and judge a chunk again knowing its file's size (its read sized by the header
        could not vouch for it): the verdict a sized read gives from the start."""
        assert isinstance(self.io, LocalIO)
        read.st = self.io.stat_fd(read.fd, read.path)
        read.out, read.view = self._sized_view(read.fd, read.st, read.out, read.key)
        read.check = VerifiedRead(
            read.fd,
            read.view,
            read.key.digest,
            reader=read.reader,
            expected_namespace=read.key.namespace,
        )
        read.check.finish()

    @staticmethod
    def _sized_view(
        fd: int, st: FileStat, buffer: memoryview | None, key: ChunkKey
    ) -> tuple[Any, memoryview]:
        """What a read of ``key``'s chunk file open at ``fd`` (of stat ``st``, from
        ``LocalIO.stat_fd``: a regular file) returns (``buffer``, or a new bytearray of the
        file's size) and the bytes of that the file fills. A file larger than ``buffer`` is
        the format error its header shows, else ConfigError (the buffer is too small)."""
        if buffer is None:
            out = bytearray(st.size)
            return out, memoryview(out)
        if st.size > len(buffer):
            # a damaged file (bytes appended, a bad header) is a corrupt miss, not the caller's
            # mistake: judged by its header alone
            _refuse_oversized(fd, st.size, len(buffer), key)
        return buffer, buffer[: st.size]

    def _end_local(self, fd: int, reader: ChunkFileReader | None) -> None:
        try:
            if reader is not None:
                reader.release()
        finally:
            os.close(fd)
        if reader is not None:
            self._count_read(reader)

    def _read_local_group(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[Any]:
        """:meth:`get_into` for a few chunks, headers first: every read's first step, then
        every payload (see :class:`VerifiedRead` for why). Per item its size, None, or the
        exception its read raised (every read of the group ends either way)."""
        started: list[Any] = []
        results: list[Any] = []
        try:
            for key, buffer in items:
                try:
                    started.append(self._start_local(key, self.path_of(key), writable_view(buffer)))
                except BaseException as exc:  # noqa: BLE001 - handed back, raised in order
                    started.append(exc)
            for read in started:
                if not isinstance(read, _LocalRead):
                    results.append(read)  # None, or the exception of the first step
                    continue
                try:
                    got = self._finish_local(read)
                except BaseException as exc:  # noqa: BLE001 - handed back, raised in order
                    results.append(exc)
                    continue
                results.append(None if got is None else got[1])
        finally:
            # An interrupt (KeyboardInterrupt) between two reads must not leave files open.
            self._close_unended(started)
        return results

    @staticmethod
    def _close_unended(reads: Sequence[Any]) -> None:
        """Close the files of started reads that have not ended (after an interrupt)."""
        for read in reads:
            if isinstance(read, _LocalRead) and not read.ended:
                read.ended = True
                with contextlib.suppress(OSError):
                    os.close(read.fd)

    def _count_read(self, reader: ChunkFileReader) -> None:
        if reader.refused and self.read_mode != BUFFERED:
            self.read_mode = BUFFERED
            log.warning(
                "%s: the filesystem under %s refuses O_DIRECT; reading through the page cache",
                self.name,
                self.root,
            )
        with self._corrupt_lock:
            if reader.went_direct:
                self._direct_reads += 1
            elif reader.dropping:
                self._cold_reads += 1
            else:
                self._cached_reads += 1

    def io_stats(self) -> FsIoStats:
        """The read mode in effect and how reads went so far."""
        return FsIoStats(
            requested=self.requested_read_mode,
            mode=self.read_mode,
            write_mode=self.write_mode,
            workers=self._pool.workers,
            direct_reads=self._direct_reads,
            cached_reads=self._cached_reads,
            cold_reads=self._cold_reads,
        )

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Read the chunk into ``buffer`` (at least the chunk's size); its size, or None."""
        view = writable_view(buffer)
        path = self.path_of(key)
        if isinstance(self.io, LocalIO):
            got = self._read_local(key, path, view)
            return None if got is None else got[1]
        return self._get_into_fsspec(key, path, view)

    def get_many_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]
    ) -> list[int | None]:
        """Batched :meth:`get_into`: each chunk into its buffer, several at a time; size or
        ``None`` per key (missing or corrupt). Every read has ended when this returns."""
        if len(keys) != len(buffers):
            raise ConfigError("get_many_into needs one buffer per key")
        # Each key once (a corrupt chunk asked for twice is counted and set aside once).
        results = read_once_per_key(keys, buffers, self._read_into_many)
        raise_first([got if isinstance(got, BaseException) else None for got in results])
        return results

    def _read_into_many(self, keys: list[ChunkKey], buffers: list[Buffer]) -> list[Any]:
        """:meth:`get_into` for keys given once each; per item its size, None, or the
        exception its read raised (once every read has ended)."""
        items = list(zip(keys, buffers))
        if not isinstance(self.io, LocalIO):
            return self._pool.map(lambda pair: self._get_into_or_error(*pair), items)
        size = max((memoryview(b).nbytes for b in buffers), default=0)
        per_group = _group_size(len(items), size, self._pool.workers)
        groups = [items[i : i + per_group] for i in range(0, len(items), per_group)]
        return [got for group in self._pool.map(self._read_local_group, groups) for got in group]

    def _get_into_or_error(self, key: ChunkKey, buffer: Buffer) -> int | None | Exception:
        try:
            return self.get_into(key, buffer)
        except Exception as exc:  # noqa: BLE001 - handed back, raised in order
            return exc

    def _get_into_fsspec(self, key: ChunkKey, path: str, view: memoryview) -> int | None:
        whole = self._read_whole(path)
        if whole is None:
            return None
        data, st = whole
        size = len(data)
        if size > len(view):
            # damaged (bytes appended, a bad header) is a miss set aside, also without verify
            # (then judged by its header, as on local paths); whole, the caller's buffer is
            # too small
            judgement = self._judge(key, data) if self.verify else judge_oversized(key, data, size)
            if not self._admit_read(key, judgement, st, data):
                return None
            raise buffer_too_small(len(view), size)
        view[:size] = data
        if self.verify and not self._valid(key, view[:size], st):
            return None
        self._touch(key, path, st)
        return size

    def read_ranges(self, key: ChunkKey, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        """The bytes of each range (one TP rank's share), or None if missing. Not checksummed."""
        path = self.path_of(key)
        try:
            got = self.io.read_ranges(path, ranges)
        except OSError as exc:
            self._read_failed(path, exc)
            return None
        if got is None:
            return None
        if self.track_access:
            with contextlib.suppress(OSError):  # access times are advisory
                st = self.io.stat(path)
                if st is not None:
                    self._touch(key, path, st)
        return got

    def _valid(self, key: ChunkKey, data: Any, st: FileStat) -> bool:
        return self._admit_read(key, self._judge(key, data), st, data)

    def _admit_read(
        self, key: ChunkKey, judgement: Judgement, st: FileStat, data: Any = None
    ) -> bool:
        """:meth:`_admit` for a read of ``data`` from the file ``st`` describes (``data`` is
        needed only where the stat cannot name the file: fsspec)."""
        if judgement.verdict is ReadVerdict.CORRUPT:
            # remember which file was bad so a concurrent good rewrite is not quarantined
            self._suspects[key] = self.io.ident_of_read(data, st)
        return self._admit(key, judgement)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # a regular file only: a directory (or anything else) at a chunk's path reads as a miss
        return [self.io.is_file(self.path_of(k)) for k in keys]

    # --- access times ------------------------------------------------------------

    def _touch(self, key: ChunkKey, path: str, st: FileStat | None, fd: int = -1) -> None:
        """Record a read of ``key``'s file as an access, at most once per
        ``access_resolution``. ``st``: the file's stat, or None to ``fstat`` the open ``fd``
        of it, only when this process's own memory of recent accesses does not settle it."""
        if not self.track_access:
            return
        now = time.time()
        last = self._touched.get(key, 0.0)
        if now - last < self.access_resolution and last > 0:
            return
        try:
            if st is None:
                st = self.io.stat_fd(fd, path) if isinstance(self.io, LocalIO) else None
            if st is None:
                return
            last = max(st.atime, last)
            recent = now - last < self.access_resolution and last > 0
            if len(self._touched) >= _TOUCH_MEMO_LIMIT:
                self._touched.clear()
            # (a recent access the file records is remembered too: the next read within the
            # resolution is settled without an fstat)
            self._touched[key] = last if recent else now
            if recent:
                return
            if not self.io.set_access(path, now, st):
                self.io.write_small(path + ".atime", L.access_bytes(now))
            if self.index is not None:
                self.index.touch([path])
        except OSError as exc:  # access times are advisory; a read never fails over them
            log.debug("%s: cannot record access to %s: %s", self.name, path, exc)

    def _access_time(self, path: str, st: FileStat, has_record: bool) -> float:
        atime = max(st.mtime, st.atime if self.io.local else 0.0)
        if has_record:
            try:
                record = self.io.read_small(path + ".atime")
            except OSError:  # unreadable (EACCES, not a regular file): counts as 0 (spec 6.5)
                record = None
            atime = max(atime, L.parse_access(record))
        return atime

    # --- writes ------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        """Store each chunk (several at a time); if any write fails, the others still end
        before the first failure is raised."""
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

    def close(self) -> None:
        """Stop the I/O threads (after the batches under way) and finish the index's
        accounting."""
        self._pool.close()
        if self.index is not None:
            self.index.close()

    def _put(self, key: ChunkKey, data: Buffer, *, replace: bool) -> bool:
        final = self.path_of(key)
        if not replace and self.io.exists(final):
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
            tmp = self._write_temp(key, view)

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
                    final, len(view), publish, replace=replace, reserved=admitting
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

    def _write_temp(self, key: ChunkKey, view: memoryview) -> str:
        name = L.temp_name(key.hex)
        if isinstance(self.io, LocalIO):
            direct = self.write_mode == DIRECT
            return self.io.write_temp(self._dir_of(key), name, view, self.fsync, direct)
        return self.io.write_temp(self._dir_of(key), name, view, self.fsync)

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

    # --- quarantine (the primitives of Upkeep) -------------------------------------

    def _suspect(self, key: ChunkKey) -> FileIdent | None:
        """Take the ident of ``key``'s file a read found corrupt (None: none recorded)."""
        return self._suspects.pop(key, None)

    def _read_current(self, key: ChunkKey) -> tuple[bytes, FileIdent | None] | None:
        return self.read_unchecked_with_idents([key])[0]

    def _set_aside(self, key: ChunkKey, ident: FileIdent | None, reason: str | None) -> SetAside:
        """Quarantine (``reason`` given) or delete the chunk file ``ident`` names.

        The file is first renamed away (to quarantine, or to a temp name in quarantine or,
        when deleting, in the state directory), and only then compared with ``ident``: a
        rename moves one inode, so what is checked is exactly what left the serving path. A
        file another writer published in between is put back (unless a yet newer one
        arrived): nothing good is lost to the race. Through fsspec the comparison is of
        contents (read again: this is the rare path), and a move is only as atomic as the
        filesystem's ``mv``.
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

    # --- listing -----------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """Namespace directories present under the root (real directories: not symlinks)."""
        entries = self.io.listdir(self.root) or []
        return sorted(n for n, is_dir in entries if is_dir and is_namespace(n))

    def _walk(
        self, namespace: str | None, shard: tuple[int, int] | None = None
    ) -> Iterator[tuple[str, str, list[tuple[str, FileStat]]]]:
        """(namespace, directory, files) for every fan-out leaf directory (of one shard
        ``(i, n)``: those whose first fan-out byte is ``i`` modulo ``n``)."""
        spaces = self.namespaces()
        if namespace is not None:
            # Only a real directory, as without a name: a namespace that is a symlink to
            # elsewhere is not the store's, and prune/verify would delete or move its files.
            spaces = [namespace] if namespace in spaces else []
        for ns in spaces:
            ns_dir = self.io.join(self.root, ns)
            for ab, ab_is_dir in sorted(self.io.listdir(ns_dir) or []):
                if not ab_is_dir or not L.FANOUT_RE.fullmatch(ab):
                    continue
                if shard is not None and int(ab, 16) % shard[1] != shard[0]:
                    continue
                ab_dir = self.io.join(ns_dir, ab)
                for cd, cd_is_dir in sorted(self.io.listdir(ab_dir) or []):
                    if not cd_is_dir or not L.FANOUT_RE.fullmatch(cd):
                        continue
                    leaf = self.io.join(ab_dir, cd)
                    yield ns, leaf, self.io.scan_files(leaf)

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        if namespace is not None:
            check_namespace(namespace)  # it becomes a path below the root
        return self._chunks(namespace, None)

    def list_shard(self, shard: tuple[int, int]) -> Iterator[ChunkInfo]:
        """The chunks of shard ``(i, n)``: whole fan-out directories, ``i`` of ``n`` by the
        key's first byte. The shards of a store together are :meth:`list`, once each."""
        return self._chunks(None, shard)

    def _chunks(self, namespace: str | None, shard: tuple[int, int] | None) -> Iterator[ChunkInfo]:
        for ns, leaf, files in self._walk(namespace, shard):
            records = {
                n[: -len(".atime")] for n, st in files if st.regular and L.classify(n) == L.ACCESS
            }
            for fname, st in files:
                if not st.regular or L.classify(fname) != L.CHUNK:
                    continue
                h = fname[: -len(L.CHUNK_SUFFIX)]
                if h[0:2] != leaf[-5:-3] or h[2:4] != leaf[-2:]:
                    continue  # a chunk in the wrong fan-out directory is foreign
                path = self.io.join(leaf, fname)
                atime = self._access_time(path, st, fname in records)
                yield ChunkInfo(ChunkKey(bytes.fromhex(h), ns), st.size, st.mtime, atime)

    def _other_files(self, kinds: tuple[str, ...]) -> Iterator[StoredFile]:
        for ns, leaf, files in self._walk(None):
            for fname, st in files:
                kind = L.classify(fname) if st.regular else L.FOREIGN  # a symlink, FIFO, dir
                if kind == L.CHUNK and (fname[0:2] != leaf[-5:-3] or fname[2:4] != leaf[-2:]):
                    kind = L.FOREIGN
                if kind in kinds:
                    yield StoredFile(self.io.join(leaf, fname), ns, st.size, st.mtime)

    def _unfinished(self) -> Iterator[StoredFile]:
        """Temp files of interrupted writes, beside the chunks."""
        return self._other_files((L.TEMP,))

    def _drop_unfinished(self, orphan: StoredFile) -> bool:
        return self.io.remove(orphan.path)

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
        """Files a set-aside staged (``quarantine/<ns>/.<hex>.<pid>.<rand>.tmp``, the same in
        the state directory) at least ``older_than`` seconds ago: a process killed between
        its two renames left them. None through fsspec (no ctime to tell their age by)."""
        return [f for _, _, f in self._staged(older_than)]

    def settle_stranded(self, grace: float = 3600.0) -> builtins.list[StrandedFile]:
        """Finish the set-asides staged more than ``grace`` seconds ago: a chunk in quarantine
        gets its quarantine name, the evidence (or is deleted where a copy already holds that
        name: quarantine keeps one per key); one in the state directory (a delete) is
        deleted. The files settled."""
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

    # --- small files (model records, the marker) -------------------------------------

    def _read_small(self, name: str) -> bytes | None:
        return self.io.read_small(self._full_path(name))

    def _write_small(self, name: str, data: bytes) -> None:
        """Write ``name`` atomically; never through a link in its directories."""
        self._refuse_link(*name.split("/")[:-1])
        self.io.write_small(self._full_path(name), data)

    def foreign_files(self) -> builtins.list[StoredFile]:
        """Files in chunk directories that are neither chunks, access records nor temp files."""
        return list(self._other_files((L.FOREIGN,)))

    def relative_path(self, path: str) -> str:
        """A :class:`StoredFile` path relative to the store's root."""
        if self.root and path.startswith(self.root):
            return path[len(self.root) :].lstrip("/\\")
        return path

    def _area_files(self, area: str) -> Iterator[tuple[str, str, int, float]]:
        """Regular files in the directories of ``area`` (``quarantine/<ns>/``)."""
        top = self.io.join(self.root, area)
        for ns, is_dir in self.io.listdir(top) or []:
            if is_dir:
                for fname, st in self.io.scan_files(self.io.join(top, ns)):
                    if st.regular:
                        yield f"{ns}/{fname}", self.io.join(top, ns, fname), st.size, st.mtime

    def usage(self) -> Usage:
        """Chunk bytes and count (the ledger when capped, else a scan)."""
        if self.capacity is not None:
            return self.capacity.usage()
        total = count = 0
        for info in self.list():
            total += info.size
            count += 1
        return Usage(total, count)

    # --- capacity hooks ------------------------------------------------------------

    def _limiter(self) -> CapacityLimiter | CapacityIndex | None:
        """What publishes and deletes go through: the cap, or, without one, the ledger-only
        limiter while a capped writer's ledger exists (so that it stays true); else None."""
        if self.capacity is not None:
            return self.capacity
        if self.io.exists(self._ledger_keeper.ledger_path):
            return self._ledger_keeper
        return None

    def _probe(self, path: str) -> tuple[int, float] | None:
        st = self.io.stat(path)
        if st is None:
            return None
        has_record = not self.io.local or self.io.exists(path + ".atime")
        return st.size, self._access_time(path, st, has_record)

    def __repr__(self) -> str:
        return (
            f"FsStore({self.root!r}, read_mode={self.read_mode!r}, "
            f"write_mode={self.write_mode!r}, io_workers={self._pool.workers})"
        )


GROUP_BYTES = 16 * 1024 * 1024
"""Buffer bytes one thread takes at once in :meth:`FsStore.get_many_into` (headers first,
then payloads): a few small chunks share the warm header step; a chunk this big or bigger
goes alone (its header work is noise against its payload, and single chunks spread best
over the threads)."""

GROUP_MAX = 4
"""At most this many reads are started ahead (open files) per thread. Measured on verified
2 MiB chunks, one thread, thread CPU per chunk over the bare read + XXH3 loop's in the same
process: 1.21-1.26x one at a time before (six runs), 1.21-1.28x one at a time in two steps
(three), 1.17-1.23x by 4 (six), 1.16-1.20x by 8 (three)."""


def _group_size(count: int, buffer_bytes: int, workers: int) -> int:
    """Chunks per group: small buffers share a group, while every thread still gets one."""
    by_bytes = GROUP_BYTES // buffer_bytes if buffer_bytes else GROUP_MAX
    return max(1, min(GROUP_MAX, by_bytes, count // workers))


def _refuse_oversized(fd: int, size: int, room: int, key: ChunkKey) -> NoReturn:
    """A chunk file of ``size`` bytes larger than the caller's buffer of ``room``: raise the
    :class:`FormatError` its own header shows (:func:`judge_oversized`: a corrupt chunk,
    quarantined like any other), else :class:`ConfigError` (a whole chunk the caller's
    buffer is too small for: the caller's mistake).

    Reads the header only (at most 16 MiB), never the file: it may be anything, of any size.
    """
    through_page_cache(fd)  # the reader may have opened it around the page cache: not aligned
    head = bytearray(min(header_bytes_needed(os.pread(fd, 8, 0)), size, 8 + MAX_HEADER_BYTES))
    got = read_into(fd, memoryview(head))
    error = judge_oversized(key, bytes(head[:got]), size).error
    if error is not None:
        raise error
    raise buffer_too_small(room, size)


@dataclass(slots=True)
class _LocalRead:
    """A local chunk read between its two steps (:meth:`FsStore._start_local`)."""

    key: ChunkKey
    path: str
    fd: int
    """The open chunk file: closed by :meth:`FsStore._finish_local`."""
    st: FileStat | None
    """Its stat; None while a verified read sized by the chunk's header has not needed it."""
    out: Any
    """What the read returns: the caller's buffer or a new bytearray."""
    view: memoryview
    """The bytes of ``out`` the chunk fills (its file size)."""
    reader: ChunkFileReader
    check: VerifiedRead | None
    """The header-checked verification, when the store verifies."""
    ended: bool = False
    """Its file is closed (or being closed): nothing may close ``fd`` again."""


def _is_local_fs(fs: Any) -> bool:
    try:
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        return False
    return isinstance(fs, LocalFileSystem)


_FS_OPTIONS = {
    "create",
    "fsync",
    "quarantine",
    "max_bytes",
    "index",
    "track_access",
    "access_resolution",
    "verify",
    "name",
    "io_workers",
    "read_mode",
    "write_mode",
}


def open_fs_store(url: str, **options: Any) -> FsStore:
    """Open a filesystem store from a bare path, ``file://`` URL or any fsspec URL.

    ``storage_options`` (a dict) is handed to fsspec; every other option to :class:`FsStore`.
    """
    storage_options = dict(options.pop("storage_options", None) or {})
    unknown = set(options) - _FS_OPTIONS
    if unknown:
        raise ConfigError(
            f"unknown option(s) for a filesystem store: {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(_FS_OPTIONS | {'storage_options'}))})"
        )
    if "://" not in url:
        return FsStore(url, **options)
    if url.startswith("file://"):
        return FsStore(url[len("file://") :] or "/", **options)
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url, **storage_options)
    except ImportError as exc:
        scheme = url.split("://")[0]
        raise MissingDependency(f"{scheme}:// needs a missing package: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"unsupported store URL {url!r}: {exc}") from None
    return FsStore(path, fs=fs, **options)
