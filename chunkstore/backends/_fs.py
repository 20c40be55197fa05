"""The filesystem store: a directory tree, local, on an NFS or Lustre mount, or any fsspec URL.

The layout is in spec/FORMAT.md, "Store layout".
:mod:`chunkstore.backends._layout` holds the names::

    <root>/chunkstore-layout.json
    <root>/<namespace>/ab/cd/<hex>.kvc

Nothing is kept only in memory: a fresh process sees every chunk on disk.
Writes go to a unique temp file in the chunk's directory.
They are renamed into place; ``put_if_absent`` renames only onto a free name.
So readers see whole chunks only, and a killed writer leaves at most an orphan temp file.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

from chunkstore.backends import _layout as L
from chunkstore.backends._capacity import CapacityLimiter, Usage
from chunkstore.backends._fastread import (
    AUTO,
    BUFFERED,
    DIRECT,
    READ_MODES,
)
from chunkstore.backends._fsio import FileStat, FsspecIO, LocalIO
from chunkstore.backends._fsreads import GROUP_BYTES as GROUP_BYTES
from chunkstore.backends._fsreads import GROUP_MAX as GROUP_MAX
from chunkstore.backends._fsreads import FsIoStats as FsIoStats
from chunkstore.backends._fsreads import FsReads
from chunkstore.backends._fsreads import _group_size as _group_size
from chunkstore.backends._fswrites import FsWrites
from chunkstore.backends._index import CapacityIndex
from chunkstore.backends._iopool import IoPool
from chunkstore.backends._upkeep import Upkeep
from chunkstore.backends.base import (
    UNSUPPORTED_GRACE,
    ChunkInfo,
    Store,
)
from chunkstore.backends.maintenance import (
    QUARANTINE_MODES,
    FileIdent,
    StoredFile,
    Strays,
)
from chunkstore.errors import (
    ConfigError,
    MissingDependency,
    StoreError,
)
from chunkstore.hashing import ChunkKey, check_namespace, is_namespace
from chunkstore.units import parse_size

log = logging.getLogger(__name__)


class FsStore(FsReads, FsWrites, Upkeep, Store):
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
        """Reads that failed with an OS error other than absence.
        Examples are EIO, ESTALE, EACCES, and a directory at a chunk's path.
        Each was logged and served as a miss."""
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

    @property
    def _has_ctime(self) -> bool:
        """Whether files show a ctime: not through fsspec, whose stat reports none."""
        return not isinstance(self.io, FsspecIO)

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
        """Raise StoreError if ``root/parts[0]``, or a deeper prefix of ``parts``, is a symlink.

        The store writes its own files only into real directories of its own.
        Those are quarantined chunks, the ledger and model records.
        It never writes through a link to elsewhere.
        There a move or an atomic replace would overwrite someone's file of the same name."""
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

    def close(self) -> None:
        """Stop the I/O threads (after the batches under way) and finish the index's
        accounting."""
        self._pool.close()
        if self.index is not None:
            self.index.close()

    # --- listing -----------------------------------------------------------------

    def namespaces(self) -> list[str]:
        """Namespace directories present under the root (real directories: not symlinks)."""
        entries = self.io.listdir(self.root) or []
        return sorted(n for n, is_dir in entries if is_dir and is_namespace(n))

    def _walk(
        self,
        namespace: str | None,
        shard: tuple[int, int] | None = None,
        skip: Callable[[str, str], bool] | None = None,
    ) -> Iterator[tuple[str, str, list[tuple[str, FileStat]]]]:
        """(namespace, directory, files) for every fan-out leaf directory.
        With a shard ``(i, n)``, only those whose first fan-out byte is ``i`` modulo ``n``.
        ``skip(directory, name)``: regular files left out unstatted (see ``scan_files``)."""
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
                    names = None if skip is None else partial(skip, leaf)
                    yield ns, leaf, self.io.scan_files(leaf, names)

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        if namespace is not None:
            check_namespace(namespace)  # it becomes a path below the root
        return self._chunks(namespace, None)

    def list_shard(self, shard: tuple[int, int]) -> Iterator[ChunkInfo]:
        """The chunks of shard ``(i, n)``: whole fan-out directories, ``i`` of ``n`` by the
        key's first byte. The shards of a store together are :meth:`list`, once each."""
        return self._chunks(None, shard)

    def _chunks(self, namespace: str | None, shard: tuple[int, int] | None) -> Iterator[ChunkInfo]:
        return (info for _, info, _ in self._walk_chunks(namespace, shard))

    def _scan_records(
        self, shard: tuple[int, int] | None
    ) -> Iterator[tuple[str, int, float, bool]]:
        """(path, size, access time, has an access record) of every chunk (of one shard),
        from the one walk: a reconcile tells the index which victims have a record."""
        for path, info, recorded in self._walk_chunks(None, shard):
            yield path, info.size, info.atime, recorded

    def _walk_chunks(
        self, namespace: str | None, shard: tuple[int, int] | None
    ) -> Iterator[tuple[str, ChunkInfo, bool]]:
        """(path, info, has an access record) of each chunk in the walked directories."""
        for ns, leaf, files in self._walk(namespace, shard):
            records = {
                n[: -len(".atime")] for n, st in files if st.regular and L.classify(n) == L.ACCESS
            }
            for fname, st in files:
                if not st.regular or L.classify(fname) != L.CHUNK:
                    continue
                if not _in_own_directory(leaf, fname):
                    continue  # a chunk in the wrong fan-out directory is foreign
                h = fname[: -len(L.CHUNK_SUFFIX)]
                path = self.io.join(leaf, fname)
                recorded = fname in records
                atime = self._access_time(path, st, recorded)
                info = ChunkInfo(ChunkKey(bytes.fromhex(h), ns), st.size, st.mtime, atime)
                yield path, info, recorded

    def _other_files(
        self, kinds: tuple[str, ...], shard: tuple[int, int] | None = None
    ) -> Iterator[tuple[str, StoredFile]]:
        """``(kind, file)`` for files of ``kinds`` in the chunk directories (of one shard):
        one listing a directory, and a stat only for what is not a chunk or access record
        there, and for an access record beside no chunk (kind :data:`LONE_RECORD`)."""
        owned: builtins.list[str] = []  # the names skip took, of the leaf being scanned

        def skip(leaf: str, fname: str) -> bool:
            if not _owned_name(leaf, fname):
                return False
            owned.append(fname)
            return True

        for ns, leaf, files in self._walk(None, shard, skip):
            for fname, st in files:
                kind = L.classify(fname) if st.regular else L.FOREIGN  # a symlink, FIFO, dir
                if kind == L.CHUNK and not _in_own_directory(leaf, fname):
                    kind = L.FOREIGN
                if kind in kinds:
                    yield kind, StoredFile(self.io.join(leaf, fname), ns, st.size, st.mtime)
            if LONE_RECORD in kinds:
                yield from self._lone_records(ns, leaf, owned, [fname for fname, _ in files])
            owned.clear()

    def _lone_records(
        self, ns: str, leaf: str, owned: builtins.list[str], statted: builtins.list[str]
    ) -> Iterator[tuple[str, StoredFile]]:
        """The access records of one listing of ``leaf`` with no chunk name beside them:
        ``owned`` are the regular chunks and records it held, ``statted`` its other names.
        Each comes with its own stat (a record vanished meanwhile is left out)."""
        present = {*owned, *statted}
        for fname in set(owned).difference(statted):  # (one statted is no regular file)
            chunk = fname[: -len(".atime")]
            if L.classify(fname) != L.ACCESS or chunk in present:
                continue
            if not _in_own_directory(leaf, chunk):
                continue  # no chunk of the store can sit here: not a record of ours to judge
            path = self.io.join(leaf, fname)
            st = self.io.stat(path)
            if st is not None:
                yield LONE_RECORD, StoredFile(path, ns, st.size, st.mtime)

    def remove_lone_records(self, files: Sequence[StoredFile]) -> builtins.list[StoredFile]:
        """Delete these access records (found by :meth:`strays`) but for those whose chunk is
        there again: a writer stored it since, and a reader may have recorded a use of it.
        Returns those that went."""
        gone = []
        for record in files:
            if self.io.exists(record.path[: -len(".atime")]):
                continue
            with contextlib.suppress(OSError):  # (gone already, or not ours to delete)
                if self.io.remove(record.path):
                    gone.append(record)
        return gone

    def _unfinished(self, shard: tuple[int, int] | None = None) -> Iterator[StoredFile]:
        """Temp files of interrupted writes, beside the chunks (of one shard)."""
        return (found for _, found in self._other_files((L.TEMP,), shard))

    def _foreign(self, shard: tuple[int, int] | None = None) -> Iterator[StoredFile]:
        """Files in chunk directories (of one shard) that are neither chunks, access records
        nor temp files."""
        return (found for _, found in self._other_files((L.FOREIGN,), shard))

    def strays(self, shard: tuple[int, int] | None = None) -> Strays:
        """Temp files, foreign files and access records beside no chunk (of one shard),
        found in one walk."""
        found: dict[str, builtins.list[StoredFile]] = {L.TEMP: [], L.FOREIGN: [], LONE_RECORD: []}
        for kind, stray in self._other_files((L.TEMP, L.FOREIGN, LONE_RECORD), shard):
            found[kind].append(stray)
        return Strays(found[L.TEMP], found[L.FOREIGN], found[LONE_RECORD])

    def _drop_unfinished(self, orphan: StoredFile) -> bool:
        return self.io.remove(orphan.path)

    # --- small files (model records, the marker) -------------------------------------

    def _read_small(self, name: str) -> bytes | None:
        return self.io.read_small(self._full_path(name))

    def _write_small(self, name: str, data: bytes) -> None:
        """Write ``name`` atomically; never through a link in its directories."""
        self._refuse_link(*name.split("/")[:-1])
        self.io.write_small(self._full_path(name), data)

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
        """What publishes and deletes go through, or None.
        That is the cap.
        Without one, it is the ledger-only limiter while a capped writer's ledger exists.
        The ledger then stays true."""
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


def _in_own_directory(leaf: str, fname: str) -> bool:
    """Whether the chunk file ``fname`` sits in its own fan-out directory ``leaf``."""
    return fname[0:2] == leaf[-5:-3] and fname[2:4] == leaf[-2:]


LONE_RECORD = "lone record"
"""The kind of an access record whose chunk is not beside it, for :meth:`FsStore._other_files`."""


def _owned_name(leaf: str, fname: str) -> bool:
    """Whether a regular file named ``fname`` in ``leaf`` is the store's own: a chunk in
    its fan-out directory, or an access record. A stray walk needs no stat of those."""
    kind = L.classify(fname)
    return kind == L.ACCESS or (kind == L.CHUNK and _in_own_directory(leaf, fname))
