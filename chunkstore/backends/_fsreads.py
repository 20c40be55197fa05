"""The filesystem store's reads: whole files, the local two-step path, access records.

:class:`FsReads` is a part of :class:`~chunkstore.backends._fs.FsStore`, mixed in.
It uses the store's own state; what it needs is declared at its top. It lives
apart so that the store's class stays short. The local read path is most of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from chunkstore.backends import _layout as L
from chunkstore.backends._batching import (
    buffer_too_small,
    first_copies,
    read_once_per_key,
    writable_view,
)
from chunkstore.backends._fastread import (
    BUFFERED,
    ChunkFileReader,
    Undecided,
    VerifiedRead,
    read_into,
    through_page_cache,
)
from chunkstore.backends._fsio import FileStat, FsspecIO, LocalIO
from chunkstore.backends._index import CapacityIndex
from chunkstore.backends._iopool import IoPool, raise_first
from chunkstore.backends.base import Buffer, Judgement, ReadVerdict, Store, judge_oversized
from chunkstore.backends.maintenance import FileIdent
from chunkstore.errors import ConfigError, FormatError
from chunkstore.format import MAX_HEADER_BYTES, ByteRange, header_bytes_needed
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)

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
    """Chunk reads in ``auto`` mode of files the page cache did not hold.
    They went through it with sequential readahead, and the file's pages were dropped after."""


class FsReads(Store):
    """Reads of a filesystem store (mixed into FsStore)."""

    if TYPE_CHECKING:  # set by FsStore
        io: LocalIO | FsspecIO
        root: str
        _pool: IoPool
        _suspects: dict[ChunkKey, FileIdent | None]
        _touched: dict[ChunkKey, float]
        track_access: bool
        access_resolution: float
        index: CapacityIndex | None
        read_errors: int
        requested_read_mode: str
        read_mode: str
        write_mode: str
        _direct_reads: int
        _cached_reads: int
        _cold_reads: int

        def path_of(self, key: ChunkKey) -> str: ...

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

    def read_unchecked_with_idents(
        self, keys: Sequence[ChunkKey]
    ) -> list[tuple[bytes, FileIdent | None] | None]:
        """Like :meth:`read_unchecked_many`, with an ident of the file each read came from.

        Hand the ident to :meth:`quarantine_if_unchanged` or :meth:`delete_if_unchanged`.
        A maintenance tool then removes the file it judged.
        It never removes one another writer put in its place since.
        The ident is the inode on local paths, and the content through fsspec.
        """
        return [
            None if got is None else (got[0], self.io.ident_of_read(*got))
            for got in self._read_versions(keys)
        ]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Chunk bytes per key; ``None`` for missing and corrupt (quarantined) chunks.

        On local paths with verification the result is a ``bytearray``.
        It is read and checksummed in one pass, with no extra copy.
        Otherwise it is ``bytes``.
        Several chunks are read at a time, see ``io_workers``.
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
        """Read a local chunk into ``buffer`` or a new bytearray.
        When verifying, it checks it in the same pass.
        Returns (buffer, size), or None if missing or corrupt."""
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
        """First step of a local read. None if missing or corrupt.

        It opens the file and chooses how bytes come in.
        When verifying, it reads and checks the header.
        Into a caller's buffer, bytes come in as ``read_mode`` says.
        The whole buffer is handed to the reader.
        Room past the chunk's end lets an O_DIRECT read take its last block whole.
        A verified read through the page cache takes the chunk's size from its header.
        It needs no ``fstat``: that is :class:`VerifiedRead` with ``sized=False``.
        Where that read cannot vouch for the file, the file is read again with its ``fstat``.
        That read judges it as before.
        The open file belongs to the returned read until :meth:`_finish_local` ends it."""
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
        """Read and judge a chunk again, knowing its file's size.
        Its read sized by the header could not vouch for it.
        Returns the verdict a sized read gives from the start."""
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
        """What a read of ``key``'s chunk file open at ``fd`` returns, and the bytes it fills.

        ``st`` is the file's stat from ``LocalIO.stat_fd``, a regular file.
        The read returns ``buffer``, or a new bytearray of the file's size.
        A file larger than ``buffer`` raises the format error its header shows.
        Else it raises ConfigError, as the buffer is too small."""
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
        """:meth:`get_into` for keys given once each.
        Per item it returns its size, None, or the exception its read raised.
        It returns once every read has ended."""
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
        """:meth:`_admit` for a read of ``data`` from the file ``st`` describes.
        ``data`` is needed only where the stat cannot name the file, as under fsspec."""
        if judgement.verdict is ReadVerdict.CORRUPT:
            # remember which file was bad so a concurrent good rewrite is not quarantined
            self._suspects[key] = self.io.ident_of_read(data, st)
        return self._admit(key, judgement)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        # a regular file only: a directory (or anything else) at a chunk's path reads as a miss
        return [self.io.is_file(self.path_of(k)) for k in keys]

    # --- access times ------------------------------------------------------------

    def _touch(self, key: ChunkKey, path: str, st: FileStat | None, fd: int = -1) -> None:
        """Record a read of ``key``'s file as an access, at most once per ``access_resolution``.
        ``st`` is the file's stat, or None to ``fstat`` the open ``fd`` of it.
        That happens only when this process's memory of recent accesses does not settle it."""
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
            recorded = not self.io.set_access(path, now, st)
            if recorded:
                self.io.write_small(path + ".atime", L.access_bytes(now))
            if self.index is not None:
                self.index.touch([path], recorded=recorded)
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


GROUP_BYTES = 16 * 1024 * 1024
"""Buffer bytes one thread takes at once in :meth:`FsStore.get_many_into`.
It takes headers first, then payloads.
A few small chunks share the warm header step.
A chunk this big or bigger goes alone.
Its header work is noise against its payload, and single chunks spread best over threads."""

GROUP_MAX = 4
"""At most this many reads, each an open file, are started ahead per thread.
Each holds its open fd and the first block it read until its payload is streamed.
Reads started ahead find their header work still in the CPU cache (``VerifiedRead``)."""


def _group_size(count: int, buffer_bytes: int, workers: int) -> int:
    """Chunks per group: small buffers share a group, while every thread still gets one."""
    by_bytes = GROUP_BYTES // buffer_bytes if buffer_bytes else GROUP_MAX
    return max(1, min(GROUP_MAX, by_bytes, count // workers))


def _refuse_oversized(fd: int, size: int, room: int, key: ChunkKey) -> NoReturn:
    """Judge a chunk file of ``size`` bytes larger than the caller's buffer of ``room``.

    Raises the :class:`FormatError` its own header shows, see :func:`judge_oversized`.
    That is a corrupt chunk, quarantined like any other.
    Else raises :class:`ConfigError`: a whole chunk the caller's buffer is too small for.
    That is the caller's mistake.

    Reads the header only, at most 16 MiB, never the file.
    The file may be anything, of any size.
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
