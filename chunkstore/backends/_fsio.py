"""File primitives under :class:`~chunkstore.backends._fs.FsStore`, behind one small surface.

Local paths use plain ``os`` calls, the fast path. Everything else uses fsspec.
Both give the store the same guarantees.
A chunk appears under its final name only complete.
It is written to a temp file in the same directory, then renamed or linked.
A reader holds either the old or the new file, never a mix.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import logging
import os
import stat as _stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from chunkstore.backends._fastread import ALIGN, O_DIRECT, is_aligned
from chunkstore.backends._layout import temp_name
from chunkstore.backends._noreplace import rename_noreplace
from chunkstore.format import ByteRange

log = logging.getLogger(__name__)

_O_NOATIME = getattr(os, "O_NOATIME", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Regular files ignore O_NONBLOCK; a FIFO left at a chunk path would block open() forever.
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


KNOWN_DIRS = 1 << 17
"""Directories one :class:`LocalIO` remembers as there (two namespaces' fan-out), a few
MB; past it, it forgets them all and learns them again, one mkdir each."""

SMALL_FILE_LIMIT = 1 << 20
"""Largest state file (layout marker, ledger, access record, model record) a store reads."""

_SET_TIME_SLACK = 1.0
"""Seconds an access time just set may read back earlier than set and still count as kept.
A coarse kernel clock for the ctime does that, or an NFS server's clock a little behind."""


@dataclass(frozen=True, slots=True)
class FileStat:
    """What the store needs to know about one file."""

    size: int
    """Bytes."""
    mtime: float
    """Last write, seconds since the epoch."""
    atime: float
    """Access time as the store set it explicitly, or 0 if unknown.
    It is the filesystem's atime, but not past the ctime.
    A plain read that moved the atime is not a use."""
    ident: tuple[int, int] | None = None
    """(inode, mtime_ns) on local filesystems. It tells a replaced file from the one read.
    None through fsspec, where the store compares contents with :func:`content_ident`."""
    regular: bool = True
    """A regular file (False: a symlink, FIFO, device or directory where a file is listed)."""
    ctime: float = 0.0
    """Last change of the inode, or 0 if unknown.
    A rename sets it, so it tells when a file was moved to its name.
    Under fsspec it is unknown: filesystems report no such time, or one meaning another thing."""


def content_ident(data: Any) -> tuple[int, int]:
    """The size and a 64-bit digest of a file's bytes.
    It tells which file a read came from where the filesystem offers no identity.
    Under fsspec a replacement with other content tells apart.
    One with the same bytes counts as the same file."""
    # (xxh3, the chunk checksum's family: verify computes this for every chunk it reads, so
    # it must cost a fraction of the check itself; a writer's replacement is no adversary)
    view = memoryview(data).cast("B")
    return view.nbytes, xxhash.xxh3_64_intdigest(view)


class LocalIO:
    """Local (or kernel-mounted: NFS, Lustre, GPFS) paths through plain ``os`` calls."""

    local = True
    sep = os.sep

    def __init__(self) -> None:
        # O_NOATIME needs file ownership; after the first EPERM stop trying (shared mounts).
        self._noatime = _O_NOATIME
        self._thread_lock = threading.Lock()
        # False once a time set did not show as the access time (a mount whose ctime does
        # not follow utime): uses then go to access records, which every reader honours.
        self._times_kept = True
        # False once a rename that refuses to replace was not there: links from then on.
        self._noreplace = True
        # Directories seen to be there (made here, or found by a mkdir): a put into one
        # makes none. A hint only: one removed since is made again by write_temp.
        self._dirs: set[str] = set()

    # --- paths ---------------------------------------------------------------

    @staticmethod
    def join(*parts: str) -> str:
        return os.path.join(*parts)

    def kind(self, path: str) -> str:
        """``dir``, ``file`` or ``missing``."""
        # One stat, not isdir() then lexists(): between two calls a concurrent creator can
        # make the directory, and "not a dir, but exists" would misreport it as a file.
        try:
            return "dir" if _stat.S_ISDIR(os.stat(path).st_mode) else "file"
        except (FileNotFoundError, NotADirectoryError):
            pass
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        # a dangling symlink is something in the way, not room for a store; a directory here
        # was made by someone else since the first stat
        return "dir" if _stat.S_ISDIR(mode) else "file"

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[tuple[str, bool]] | None:
        """(name, is_dir) per entry, or None when ``path`` is not a directory."""
        try:
            with os.scandir(path) as it:
                return [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return None

    def scan_files(
        self, path: str, skip: Callable[[str], bool] | None = None
    ) -> list[tuple[str, FileStat]]:
        """Entries directly in ``path`` with their own stat, symlinks not followed.
        Entries that vanish meanwhile are skipped.
        Anything but a regular file has ``regular`` False.
        A store lists it as foreign and never as a chunk.

        A regular file whose name ``skip`` accepts is left out unstatted: the directory's
        own listing says it is a regular file, so a walk for strays costs a listing per
        directory, not a stat per chunk."""
        out: list[tuple[str, FileStat]] = []
        try:
            it = os.scandir(path)
        except (FileNotFoundError, NotADirectoryError):
            return out
        with it:
            for entry in it:
                if skip is not None and skip(entry.name):
                    try:
                        if entry.is_file(follow_symlinks=False):
                            continue
                    except OSError:
                        pass  # the stat below tells
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((entry.name, _filestat(st, _stat.S_ISREG(st.st_mode))))
        return out

    # --- reads ---------------------------------------------------------------

    def _open_read(self, path: str) -> tuple[int, os.stat_result] | None:
        """An fd of the regular file at ``path`` and its fstat; None if there is none.

        Raises ``OSError`` for anything but absence.
        That is EIO, ESTALE, EACCES, or a directory or other non-regular file at the path.
        The store turns those into logged misses.
        """
        fd = self.open_fd(path)
        if fd is None:
            return None
        try:
            st = _regular_fstat(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def open_fd(self, path: str) -> int | None:
        """An fd open for reading whatever is at ``path``, or None if nothing is.

        The caller closes it.
        It learns from :meth:`stat_fd` or its reads whether it is a regular file.

        Raises ``OSError`` for anything but absence (EIO, ESTALE, EACCES).
        """
        flags = os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK
        try:
            try:
                return os.open(path, flags | self._noatime)
            except PermissionError as exc:
                if not self._noatime or exc.errno != errno.EPERM:
                    raise
                self._noatime = 0  # not the owner: O_NOATIME is refused, plain reads still work
                # Harmless: the atime such a read moves is not taken for a use (_filestat).
                log.debug("%s: not the owner, reading without O_NOATIME from now on", path)
                return os.open(path, flags)
        except (FileNotFoundError, NotADirectoryError):
            return None

    @staticmethod
    def stat_fd(fd: int, path: str) -> FileStat:
        """The stat of an fd from :meth:`open_fd`; ``OSError`` unless it is a regular file."""
        return _filestat(_regular_fstat(fd, path))

    def read(self, path: str) -> tuple[bytes, FileStat] | None:
        """Whole file and its stat, from one open file (so both describe the same inode)."""
        opened = self._open_read(path)
        if opened is None:
            return None
        fd, st = opened
        try:
            data = os.read(fd, st.st_size)
            if len(data) < st.st_size:  # rare short read (signals, network mounts)
                parts = [data]
                got = len(data)
                while got < st.st_size:
                    more = os.read(fd, st.st_size - got)
                    if not more:
                        break
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
            return data, _filestat(st)
        finally:
            os.close(fd)

    def read_ranges(self, path: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        opened = self._open_read(path)
        if opened is None:
            return None
        fd = opened[0]
        try:
            return [os.pread(fd, r.length, r.offset) for r in ranges]
        finally:
            os.close(fd)

    @staticmethod
    def ident_of_read(data: Any, st: FileStat) -> tuple[int, int] | None:
        """Which file a read of ``data`` (stat ``st``) came from: its inode and mtime."""
        return st.ident

    @staticmethod
    def ident_at(path: str, st: FileStat) -> tuple[int, int] | None:
        """Which file is at ``path`` now (``st``: its stat, just taken)."""
        return st.ident

    def stat(self, path: str) -> FileStat | None:
        try:
            return _filestat(os.stat(path))
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    @staticmethod
    def is_link(path: str) -> bool:
        """Whether ``path`` is a symbolic link (dangling or not)."""
        return os.path.islink(path)

    def is_file(self, path: str) -> bool:
        """Whether a regular file is at ``path`` (False on any error: a miss)."""
        return os.path.isfile(path)

    def read_small(self, path: str) -> bytes | None:
        """A whole small file, or None if missing.

        Such files are a marker, a ledger or an access record.
        It is opened as chunks are: anything but a regular file is an ``OSError``.
        So a FIFO left at the path is refused instead of blocking until a writer comes.
        A file over :data:`SMALL_FILE_LIMIT` is refused too, with EFBIG.
        No state file this code writes comes near it.
        A damaged one is then not read into memory whole.
        """
        opened = self._open_read(path)
        if opened is None:
            return None
        fd, st = opened
        try:
            if st.st_size > SMALL_FILE_LIMIT:
                raise OSError(errno.EFBIG, f"larger than {SMALL_FILE_LIMIT} bytes", path)
            return _read_at_most(fd, SMALL_FILE_LIMIT)  # (bounded: it may grow meanwhile)
        finally:
            os.close(fd)

    # --- writes --------------------------------------------------------------

    def make_dir(self, directory: str) -> bool:
        """Make ``directory`` (and its parents) unless this object saw it already; True when
        this call made it, so that it held nothing a moment ago.

        One mkdir (and one for each parent missing), as a bare write loop makes, where a
        first open would fail, then a stat of each parent and a mkdir (each a request to a
        network filesystem's metadata server). Any other error is left for the write to
        meet and report."""
        if directory in self._dirs:
            return False
        try:
            made = _mkdir_parents(directory)
        except OSError:
            return False
        if len(self._dirs) >= KNOWN_DIRS:
            self._dirs.clear()
        self._dirs.add(directory)
        return made

    def write_temp(
        self, directory: str, name: str, data: Any, fsync: bool, direct: bool = False
    ) -> str:
        """Write ``data`` to ``directory/name`` (created exclusively); returns the path.

        ``direct``: write around the page cache (O_DIRECT) when ``data`` is page-aligned
        (a host-cache slot); see :func:`write_all`."""
        path = os.path.join(directory, name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
        for attempt in range(3):
            try:
                fd = os.open(path, flags, 0o644)
                break
            except FileNotFoundError:
                # the fan-out directory does not exist yet (or was removed since make_dir)
                if attempt == 2:
                    raise
                _mkdir_parents(directory)
                self._dirs.add(directory)
        try:
            write_all(fd, memoryview(data).cast("B"), direct)
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        return path

    def _sync_dir(self, directory: str) -> None:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            fd = os.open(directory, os.O_RDONLY | _O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def replace(self, tmp: str, final: str, fsync: bool) -> None:
        os.replace(tmp, final)
        if fsync:
            self._sync_dir(os.path.dirname(final))

    def link_if_absent(self, tmp: str, final: str, fsync: bool) -> bool:
        """Publish ``tmp`` as ``final`` unless it exists; ``tmp`` is gone afterwards.

        One rename that refuses to replace where the system has it (one metadata
        operation), else a hard link and then removing ``tmp`` (two)."""
        written = rename_noreplace(tmp, final) if self._noreplace else None
        if written is None:
            self._noreplace = False
            written = self._link_if_absent(tmp, final)
        elif not written:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if written and fsync:
            self._sync_dir(os.path.dirname(final))
        return written

    @staticmethod
    def _link_if_absent(tmp: str, final: str) -> bool:
        """:meth:`link_if_absent` by a hard link, on systems without the rename."""
        try:
            os.link(tmp, final)
            written = True
        except FileExistsError:
            written = False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            # No hard links here (some FUSE/SMB mounts): check then rename. Two racing
            # writers may both "win", but each rename is atomic, so no reader sees a mix.
            written = not os.path.exists(final)
            if written:
                os.replace(tmp, final)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        return written

    def remove(self, path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    def move(self, src: str, dst: str) -> bool:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.replace(src, dst)
            return True
        except FileNotFoundError:
            return False

    def write_small(self, path: str, data: bytes) -> None:
        """Replace a small file atomically (temp + rename)."""
        directory, name = os.path.split(path)
        os.makedirs(directory, exist_ok=True)
        # a random temp name (not pid + thread id): a killed writer's leftover must not
        # collide with a later process that happens to get the same pid and thread id
        tmp = self.write_temp(directory, temp_name(name), data, False)
        os.replace(tmp, path)

    def set_access(self, path: str, now: float, st: FileStat) -> bool:
        """Record an access in the file's own atime, set explicitly so noatime mounts keep it.

        Only the file that was read, ``st.ident``, is touched, through an fd of it.
        Its mtime is kept to the nanosecond.
        A file another writer put in its place since keeps its own times.
        It keeps its ``ident`` too, which the quarantine guard compares.
        Returns False when not allowed, as for another user's file.
        Returns False too where a time set does not show as the access time.
        That happens on a mount whose ctime does not follow ``utime``.
        An example is sshfs, which reports the mtime as the ctime.
        :func:`_filestat` bounds the atime by the ctime.
        On False the caller writes an access record.
        """
        if not self._times_kept:
            return False
        try:
            opened = self._open_read(path)
        except PermissionError:
            return False
        if opened is None:
            return True  # deleted meanwhile: nothing to record
        fd, current = opened
        try:
            if st.ident is not None and (current.st_ino, current.st_mtime_ns) != st.ident:
                return True  # replaced since the read: the new file is as fresh as its mtime
            os.utime(fd, ns=(int(now * 1e9), current.st_mtime_ns))
            if _filestat(os.fstat(fd)).atime < now - _SET_TIME_SLACK:
                self._times_kept = False
                log.info("%s: set times do not show on this mount; uses go to records", path)
                return False
            return True
        except PermissionError:
            return False
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EROFS):
                return False
            raise
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def lock(self, path: str) -> Iterator[None]:
        """Exclusive lock between threads and processes (flock; NFSv4 maps it to POSIX locks)."""
        with self._thread_lock:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # opened per acquisition: an fd shared across fork would share the lock too
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing releases the flock


def _mkdir_parents(path: str) -> bool:
    """Make ``path`` and any parents missing, each tried with mkdir first (no stat before):
    True if ``path`` was made here, False if it was there."""
    try:
        os.mkdir(path)
    except FileExistsError:
        return False
    except FileNotFoundError:
        parent = os.path.dirname(path)
        if not parent or parent == path:
            raise
        _mkdir_parents(parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            return False
    return True


def write_all(fd: int, view: memoryview, direct: bool = False) -> None:
    """Write all of ``view`` at the fd's position.

    With ``direct`` and a page-aligned ``view``, the whole pages go out with O_DIRECT.
    They go from the caller's memory to the device, with no page-cache copy.
    The last, partial page goes through the page cache.
    A filesystem that refuses O_DIRECT gets a plain write.
    """
    done = 0
    body = len(view) - len(view) % ALIGN if direct and O_DIRECT and is_aligned(view) else 0
    if body:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
        except OSError:
            body = 0
        try:
            while done < body:
                done += os.write(fd, view[done:body])
        except OSError as exc:
            if exc.errno != errno.EINVAL or done % ALIGN:
                raise
        finally:
            if body:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    while done < len(view):
        done += os.write(fd, view[done:])


def read_regular(path: str, limit: int) -> bytes | None:
    """Up to ``limit`` bytes from the start of the regular file at ``path``.
    None if nothing is there.
    Raises ``OSError`` for anything else, such as EACCES, a directory or a FIFO.
    A FIFO is opened without waiting for a writer and refused.
    :class:`LocalIO` opens a store's files the same way."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        _regular_fstat(fd, path)
        return _read_at_most(fd, limit)
    finally:
        os.close(fd)


def _read_at_most(fd: int, limit: int) -> bytes:
    """The bytes of ``fd`` from its position to its end, at most ``limit`` of them.
    They are read in pieces of at most 64 KiB.
    Each read allocates what it asks for, and most files are tiny."""
    parts: list[bytes] = []
    got = 0
    while got < limit and (part := os.read(fd, min(limit - got, 1 << 16))):
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _regular_fstat(fd: int, path: str) -> os.stat_result:
    """``fstat(fd)``; ``OSError`` (EISDIR or EINVAL) unless ``fd`` is a regular file."""
    st = os.fstat(fd)
    if not _stat.S_ISREG(st.st_mode):
        raise OSError(
            errno.EISDIR if _stat.S_ISDIR(st.st_mode) else errno.EINVAL,
            "not a regular file",
            path,
        )
    return st


def _filestat(st: os.stat_result, regular: bool = True) -> FileStat:
    # The access time the store set, not a plain read's (spec/FORMAT.md 6.5): setting times
    # moves the ctime along with the atime, a read that moves the atime (a process that may
    # not use O_NOATIME: not the files' owner, e.g. an operator's `verify`) leaves the ctime.
    # So an atime past the ctime was no recorded use; the ctime bounds it.
    atime = min(st.st_atime, st.st_ctime)
    ident = (st.st_ino, st.st_mtime_ns)
    return FileStat(st.st_size, st.st_mtime, atime, ident, regular, st.st_ctime)


def _info_time(info: dict[str, Any], *names: str) -> float:
    for name in names:
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, _dt.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=_dt.timezone.utc)
            return value.timestamp()
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return 0.0


class FsspecIO:
    """Any fsspec filesystem. Atomicity is the filesystem's ``mv``: atomic on real filesystems,
    copy-then-delete on some object stores (use :class:`~chunkstore.backends._s3.S3Store` for S3).
    Locks are per process only: capacity accounting assumes one writer process."""

    local = False
    sep = "/"

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self._thread_lock = threading.RLock()

    @staticmethod
    def join(*parts: str) -> str:
        return "/".join(p.rstrip("/") if i == 0 else p.strip("/") for i, p in enumerate(parts))

    def kind(self, path: str) -> str:
        # One info() call, not isdir() then exists(): a directory made by a concurrent
        # creator between two calls would read as "exists but not a dir", i.e. a file.
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return "missing"
        return "dir" if info.get("type") == "directory" else "file"

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def _ls(self, path: str) -> list[dict[str, Any]] | None:
        try:
            return list(self.fs.ls(path, detail=True))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def listdir(self, path: str) -> list[tuple[str, bool]] | None:
        entries = self._ls(path)
        if entries is None:
            return None
        return [
            (e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("type") == "directory")
            for e in entries
        ]

    def scan_files(
        self, path: str, skip: Callable[[str], bool] | None = None
    ) -> list[tuple[str, FileStat]]:
        out = []
        for e in self._ls(path) or []:
            if e.get("type") == "directory":
                continue
            if skip is not None and skip(e["name"].rsplit("/", 1)[-1]):
                continue  # the listing holds only files here: skipped names are regular
            mtime = _info_time(e, "mtime", "LastModified", "last_modified", "created")
            name = e["name"].rsplit("/", 1)[-1]
            out.append((name, FileStat(int(e.get("size") or 0), mtime, 0.0)))
        return out

    def read(self, path: str) -> tuple[bytes, FileStat] | None:
        try:
            data = self.fs.cat_file(path)
        except (FileNotFoundError, IsADirectoryError):
            return None
        return data, FileStat(len(data), 0.0, 0.0)

    @staticmethod
    def ident_of_read(data: Any, st: FileStat) -> tuple[int, int] | None:
        """Which file a read of ``data`` came from: its content (:func:`content_ident`)."""
        return None if data is None else content_ident(data)

    def ident_at(self, path: str, st: FileStat) -> tuple[int, int] | None:
        """Which file is at ``path`` now: its content, read again (None if gone)."""
        got = self.read(path)
        return None if got is None else content_ident(got[0])

    def read_ranges(self, path: str, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        try:
            return [self.fs.cat_file(path, start=r.offset, end=r.offset + r.length) for r in ranges]
        except FileNotFoundError:
            return None

    def stat(self, path: str) -> FileStat | None:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        mtime = _info_time(info, "mtime", "LastModified", "last_modified", "created")
        return FileStat(int(info.get("size") or 0), mtime, 0.0)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    @staticmethod
    def is_link(path: str) -> bool:
        """Always False: fsspec paths are followed by the filesystem itself."""
        return False

    def is_file(self, path: str) -> bool:
        """Whether a file (not a directory) is at ``path`` (False on any error: a miss)."""
        try:
            return bool(self.fs.isfile(path))
        except OSError:
            return False

    def read_small(self, path: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(path))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    @staticmethod
    def make_dir(directory: str) -> bool:
        """False: :meth:`write_temp` makes the directory as it writes (one call to fsspec)."""
        del directory
        return False

    def write_temp(self, directory: str, name: str, data: Any, fsync: bool) -> str:
        path = self.join(directory, name)
        self.fs.makedirs(directory, exist_ok=True)
        self.fs.pipe_file(path, bytes(memoryview(data).cast("B")))
        return path

    def replace(self, tmp: str, final: str, fsync: bool) -> None:
        self.fs.mv(tmp, final)

    def link_if_absent(self, tmp: str, final: str, fsync: bool) -> bool:
        # Note: check-then-move; atomic against threads of this process (the lock),
        # a race between processes can make both "win" (each move is still whole).
        with self._thread_lock:
            written = not self.fs.exists(final)
            if written:
                self.fs.mv(tmp, final)
        if not written:
            self.remove(tmp)
        return written

    def remove(self, path: str) -> bool:
        try:
            self.fs.rm_file(path)
            return True
        except FileNotFoundError:
            return False

    def move(self, src: str, dst: str) -> bool:
        self.fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
        try:
            self.fs.mv(src, dst)
            return True
        except FileNotFoundError:
            return False

    def write_small(self, path: str, data: bytes) -> None:
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    def set_access(self, path: str, now: float, st: FileStat) -> bool:
        return False  # fsspec cannot set times: the store writes an access record

    @contextlib.contextmanager
    def lock(self, path: str) -> Iterator[None]:
        with self._thread_lock:
            yield
