"""Read a chunk file into a buffer and verify it in the same pass: the local fast path.

Reading a whole 32 MiB chunk and then hashing it walks the data twice through memory.
Here each block is hashed right after ``preadv`` copied it, while it is in the CPU cache.
That keeps verified reads close to raw reads.
The verdict is exactly that of :func:`chunkstore.format.decode_chunk` with ``expected_key``.
The checksum is the one spec/FORMAT.md defines.
It is xxh3-128 over the header with the checksum field zeroed, then the stored payload.
Compressed chunks go through ``decode_chunk`` itself.

Bytes reach the buffer in one of three ways, see :class:`ChunkFileReader`.

* ``buffered``: through the page cache, with ``preadv``.
* ``direct``: around it with ``O_DIRECT``, straight into a page-aligned buffer.
  Host-cache slots are page-aligned.
  The file's last, partial block comes through the page cache.
  It does not when the buffer has room for the whole aligned block.
* ``auto``: one ``RWF_NOWAIT`` read of the file's first page tells whether the page
  cache holds the file. That read never waits for the disk.
  A cached file is read through the page cache.
  A cold file goes around the page cache into a buffer of up to :data:`READAHEAD_FROM` bytes.
  So does a larger buffer on huge pages that chunkstore mapped.
  Any other larger buffer is read through the page cache with sequential readahead.
  The file's pages are then dropped when the read ends, see :meth:`ChunkFileReader.release`.
  Either way a cold chunk bound for the host cache is not also kept in the page cache.
  It does not push hot files out of it.
  Chunk files are written and read whole, so the first page stands for the rest.
  A file only partly cached is still read correctly either way.
  Readahead is off for the probe.
  A missed ``RWF_NOWAIT`` read would otherwise start reading the file in the background.
  That would compete with the read that follows.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
from typing import Any

from chunkstore._hugepages import covers
from chunkstore.errors import (
    FormatError,
    LayoutError,
    TruncatedChunk,
    UnknownCompression,
    UnknownDType,
    UnsupportedFeature,
)
from chunkstore.format import (
    ChunkHeader,
    PayloadVerifier,
    decode_chunk,
    header_bytes_needed,
    read_header,
)

BLOCK = 256 * 1024
"""Bytes read and hashed per step through the page cache: small enough to stay in L2."""

DIRECT_BLOCK = 8 * 1024 * 1024
"""Bytes per read around the page cache, so the disk sees few, large requests.
DMA lands in RAM, not in the CPU cache, so hashing in small steps would gain nothing."""

READAHEAD_FROM = DIRECT_BLOCK
"""Size above which ``auto`` mode reads a cold buffer on 4 KiB pages with readahead.

Such a buffer needs more than one ``O_DIRECT`` request.
It is read through the page cache, then dropped from it.
The disk then works ahead while the thread copies and hashes.
``O_DIRECT`` would wait for each 8 MiB request in turn, split by the scattered pages.
Smaller chunks stay direct: one request, and readahead gains nothing there.
A buffer on huge pages that chunkstore mapped stays direct at any size.
:func:`chunkstore._hugepages.covers` tells such buffers apart.
Host cache slots of a private pool and the native tier's chunk buffers are such buffers.
See docs/benchmarks.md, Stores and "Host slots on huge pages"."""

ALIGN = 4096
"""Alignment O_DIRECT needs for memory, file offsets and lengths (a page; covers 512 and 4K
logical blocks)."""

BUFFERED = "buffered"
DIRECT = "direct"
AUTO = "auto"
READ_MODES = (BUFFERED, DIRECT, AUTO)
"""How a :class:`ChunkFileReader` may bring bytes in (see the module docstring)."""

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)


def is_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts on an :data:`ALIGN` boundary (needs a writable view)."""
    if len(view) == 0 or view.readonly:
        return False
    return _address(view) % ALIGN == 0


def _address(view: memoryview) -> int:
    """Where a writable, non-empty ``view`` starts in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def on_huge_pages(view: memoryview) -> bool:
    """Whether a writable, non-empty ``view`` lies in memory chunkstore mapped on huge pages
    (:func:`chunkstore._hugepages.covers`)."""
    return covers(_address(view), len(view))


def through_page_cache(fd: int) -> None:
    """Take ``O_DIRECT`` off ``fd``, which a :class:`ChunkFileReader` may have set.
    Reads of any length, at any offset, into any memory may then follow."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & O_DIRECT:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)


def _read_exact(fd: int, view: memoryview, offset: int) -> int:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            break
        got += n
    return got


def read_into(fd: int, target: memoryview) -> int:
    """Fill ``target`` from the start of ``fd`` through the page cache; bytes read."""
    return _read_exact(fd, target, 0)


class ChunkFileReader:
    """Brings spans of one open file into ``buffer`` at the same offsets.

    ``buffer`` may be longer than the file.
    In ``direct`` mode the room past the file's end lets its last block be read whole
    and aligned.
    ``mode`` is one of :data:`READ_MODES`.
    A buffer that is not page-aligned is always read ``buffered``.
    In ``auto`` mode the constructor asks the page cache with one non-blocking read of
    the first page.
    A cold file goes around the page cache.
    Into a buffer over :data:`READAHEAD_FROM` not on huge pages, it goes through it.
    :func:`on_huge_pages` tells huge pages apart.
    That read uses sequential readahead and sets :attr:`dropping`.
    :meth:`release` then drops its pages once the read is over.
    After the reads, :attr:`went_direct` says whether any bytes bypassed the page cache.
    :attr:`refused` says whether the filesystem rejected O_DIRECT.
    The reader then finished buffered.
    """

    __slots__ = ("buffer", "direct", "dropping", "fd", "probed", "refused", "went_direct")

    PROBE = ALIGN
    """Bytes the ``auto`` mode reads without waiting to learn whether the file is cached."""

    def __init__(self, fd: int, buffer: memoryview, mode: str = BUFFERED) -> None:
        self.fd = fd
        self.buffer = buffer
        self.direct = False
        self.went_direct = False
        self.refused = False
        self.probed = 0
        """Bytes from the file's start the ``auto`` probe already put into the buffer."""
        self.dropping = False
        """Whether the file was cold (``auto``): read through the page cache, its pages
        dropped by :meth:`release`."""
        capable = mode != BUFFERED and bool(O_DIRECT) and is_aligned(buffer)
        if capable and mode == AUTO:
            capable = bool(_RWF_NOWAIT) and not self._cached()
            if capable and len(buffer) > READAHEAD_FROM and not on_huge_pages(buffer):
                capable = False
                self.dropping = True
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if capable:
            self._set_direct(True)

    @property
    def block(self) -> int:
        """Bytes worth reading (and hashing) per step in the current mode."""
        return DIRECT_BLOCK if self.direct else BLOCK

    def read(self, start: int, end: int) -> int:
        """Fill ``buffer[start:end]`` from file offset ``start``; bytes read (fewer only when
        the file ends first)."""
        return self._read(start, end)

    def release(self) -> None:
        """The read is over, the fd still open: drop a cold file's pages from the page cache.
        Only clean pages go. A file being written keeps its dirty ones."""
        if self.dropping:
            with contextlib.suppress(OSError):  # only advice: the read itself succeeded
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _cached(self) -> bool:
        """Whether the page cache holds the file's first page. True where the filesystem
        cannot tell.
        The page is read into the buffer, never waiting for the disk."""
        view = self.buffer[: self.PROBE]
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            self.probed = os.preadv(self.fd, [view], 0, _RWF_NOWAIT)
            return self.probed > 0
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
            return True
        finally:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_NORMAL)

    def _read(self, start: int, end: int) -> int:
        if not self.direct or start % ALIGN:
            return _read_exact(self.fd, self.buffer[start:end], start)
        room = len(self.buffer)
        padded = end if end % ALIGN == 0 else end + ALIGN - end % ALIGN
        body_end = padded if padded <= room else end - end % ALIGN
        got = 0
        if body_end > start:
            got = self._read_direct(start, body_end)
            if got < 0:  # refused: the rest through the page cache
                return _read_exact(self.fd, self.buffer[start:end], start)
            if got < body_end - start:
                return min(got, end - start)  # end of file
        if body_end < end:
            # The unaligned tail of the file, with no room for a whole aligned block after it.
            self._set_direct(False)
            got += _read_exact(self.fd, self.buffer[body_end:end], body_end)
        return min(got, end - start)

    def _read_direct(self, start: int, end: int) -> int:
        """Aligned read around the page cache; bytes read, or -1 if the filesystem refused."""
        got = 0
        while start + got < end:
            try:
                n = os.preadv(self.fd, [self.buffer[start + got : end]], start + got)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.refused = True
                self._set_direct(False)
                return -1
            if n <= 0:
                break
            self.went_direct = True
            got += n
            if n % ALIGN:
                break  # a partial block: the file ends here
        return got

    def _set_direct(self, on: bool) -> bool:
        """Switch the fd to or from O_DIRECT; False if the filesystem refuses."""
        if self.direct == on:
            return True
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | O_DIRECT if on else flags & ~O_DIRECT)
        except OSError:
            self.refused = on
            return False
        self.direct = on
        return True


HEAD_READ = ALIGN
"""Bytes the first read of a buffered verified read brings in.
That is the header of a chunk of up to a few hundred tensors.
A longer header takes one more read.
The payload follows in its own step, :meth:`VerifiedRead.finish`.
So a batch can parse several headers back to back before streaming their payloads."""


class Undecided(Exception):
    """A read that took the chunk's size from its header met anything but a valid chunk.

    Such a read is ``VerifiedRead(sized=False)``.
    It may have met a file shorter or longer than its header says, or a damaged header.
    It may have met a checksum or key that does not match, or an OS error.
    It vouches for nothing.
    The caller reads the file again knowing its size, which gives the verdict as before.
    This is rare: only damaged or racing files land here."""


_PAST_END = bytearray(1)
"""Where the last block's read puts the byte after the chunk's end, if the file has one.
Only the count the kernel returns is looked at.
Threads share it, as its content never matters."""


class VerifiedRead:
    """A verified read of one chunk file into ``target``, in two steps.

    Constructing it reads and parses the header and sets up the payload's checksum.
    Key derivation and identity are checked here.
    :meth:`finish` streams the payload block by block and gives the verdict.
    It hashes each block right after it lands.
    Both steps raise :class:`~chunkstore.errors.FormatError` subclasses.
    They raise what :func:`chunkstore.format.decode_chunk` with ``expected_key`` would.
    The verdict is the same too.
    A chunk damaged in both its key and its bytes is reported as a key mismatch.
    The key is checked first.
    After a failure ``target`` holds garbage.

    With ``sized``, the default, ``target`` is exactly the file's size from ``fstat``.
    With ``sized=False``, ``target`` is a buffer at least as long as the chunk.
    The chunk's size then comes from its header: ``data_offset + stored_size``.
    The last block's read asks for one byte more.
    So a file longer than its header says is seen without an ``fstat``, as surely as a
    shorter one.
    In this mode either step raises :class:`Undecided` instead of any ``FormatError`` or
    ``OSError``.
    The caller then judges the file with its size in hand.
    The verdict, its message and what is checked first stay those of the sized read.
    This mode reads uncompressed chunks through the page cache only.
    Anything else is :class:`Undecided` at once.
    When it finishes, the chunk is whole and valid, and :attr:`target` is its bytes.

    Why two steps: streaming a 2 MiB payload through the CPU cache evicts
    what the next chunk's header parse and verifier set-up touch.
    A batch that starts a few reads before finishing any thus finds that work
    still in the CPU cache.
    Meanwhile each read holds its open fd and what its first step read.
    That is the header's page, or with O_DIRECT the first block of up to 8 MiB.

    ``reader`` chooses how bytes come in, by default through the page cache.
    It is a :class:`ChunkFileReader` over ``fd`` and a buffer starting with ``target``.
    """

    __slots__ = (
        "_fd",
        "_first",
        "_reader",
        "_sized",
        "expected_key",
        "expected_namespace",
        "header",
        "target",
        "verifier",
    )

    def __init__(
        self,
        fd: int,
        target: memoryview,
        expected_key: bytes | None,
        *,
        reader: Any = None,
        sized: bool = True,
        expected_namespace: str | None = None,
    ) -> None:
        src: ChunkFileReader = reader if reader is not None else ChunkFileReader(fd, target)
        self._fd = fd
        self._reader = src
        self._sized = sized
        self.target = target
        self.expected_key = expected_key
        self.expected_namespace = expected_namespace
        self.verifier: PayloadVerifier | None = None
        self.header: ChunkHeader | None = None
        if sized:
            self._start()
            return
        if src.direct:
            raise Undecided("a read around the page cache needs the file's size")
        try:
            self._start()
        except (FormatError, OSError) as exc:
            raise Undecided(str(exc)) from exc

    def _fill(self, start: int, end: int) -> None:
        """Fill ``target[start:end]`` through the reader; raises if the file ends first."""
        if self._reader.read(start, end) < end - start:
            raise TruncatedChunk("chunk file shrank while being read")

    def _start(self) -> None:
        target, fill, src = self.target, self._fill, self._reader
        room = len(target)
        # Around the page cache the first request stays large (the disk sees few, big reads);
        # through it, only the header comes in now.
        first = min(room, src.block if src.direct else HEAD_READ)
        if src.probed < first:
            fill(src.probed, first)
        header_len = header_bytes_needed(bytes(target[:8])) if room >= 8 else room
        if first < header_len <= room:
            fill(first, header_len)
            first = header_len
        self._first = first
        try:
            header = read_header(
                target[:first]
            )  # raises BadMagic/TruncatedChunk/... like decode_chunk
        except (UnknownCompression, UnknownDType, UnsupportedFeature):
            # A newer minor's chunk is unsupported only if intact: the whole-file check of
            # _finish (decode_chunk) tests its checksum first (spec section 3.4).
            if not self._sized:
                raise Undecided("a newer minor's chunk: judged by a whole read") from None
            self.header = None
            return
        self.header = header
        if not self._sized:
            size = header.data_offset + header.stored_size
            if header.compression != "none" or not first <= size <= room:
                raise Undecided("not an uncompressed chunk that fits the buffer")
            self.target = target[:size]
        elif header.compression != "none":
            return
        stored = len(self.target) - header.data_offset
        if stored != header.stored_size:
            error = TruncatedChunk if stored < header.stored_size else LayoutError
            raise error(f"payload has {stored} bytes, header says {header.stored_size}")
        self.verifier = PayloadVerifier(
            header,
            target,
            expected_key=self.expected_key,
            expected_namespace=self.expected_namespace,
        )

    def finish(self) -> None:
        """Read and hash the payload; raises unless the whole chunk is valid."""
        if self._sized:
            self._finish()
            return
        try:
            self._finish()
        except (FormatError, OSError) as exc:
            raise Undecided(str(exc)) from exc

    def _finish(self) -> None:
        target, first = self.target, self._first
        size = len(target)
        verifier, header = self.verifier, self.header
        if verifier is None or header is None:  # compressed or newer: decode_chunk judges all
            self._fill(first, size)
            decode_chunk(
                target,
                expected_key=self.expected_key,
                expected_namespace=self.expected_namespace,
            )
            return
        data_offset = header.data_offset
        if first > data_offset:
            verifier.update(target[data_offset:first])
        pos = max(first, data_offset)
        fd, update, sized = self._fd, verifier.update, self._sized
        block, direct = self._reader.block, self._reader.direct
        preadv = os.preadv
        if pos >= size and not sized:
            self._fill_last(size, size)  # no payload left to read: only the byte past the end
        # This loop runs ~9 times per 2 MiB chunk with the GIL held: through the page cache
        # one preadv nearly always fills the block, called right here; anything else (a short
        # read, O_DIRECT) goes through the reader.
        while pos < size:
            end = min(pos + block, size)
            span = target[pos:end]
            if end == size and not sized:
                self._fill_last(pos, end)  # sized by its header: the byte past the end too
            elif direct or preadv(fd, [span], pos) != end - pos:
                self._fill(pos, end)
            update(span)
            pos = end
        verifier.finish()

    def _fill_last(self, start: int, size: int) -> None:
        """Read ``target[start:size]``, the chunk's last bytes, with the byte past its end.
        Raises unless the file holds exactly ``size`` bytes, the size its header gives."""
        got = os.preadv(self._fd, [self.target[start:size], _PAST_END], start)
        if got != size - start:
            raise TruncatedChunk(f"file holds {start + got} bytes or more, header says {size}")


def read_verified_into(
    fd: int,
    target: memoryview,
    expected_key: bytes | None,
    *,
    reader: Any = None,
    expected_namespace: str | None = None,
) -> None:
    """Fill ``target``, exactly the file's size, from ``fd`` and validate it as a chunk.

    This runs both steps of :class:`VerifiedRead` at once.
    Raises a :class:`~chunkstore.errors.FormatError` subclass if the bytes are not a valid chunk.
    It raises one too if they are not the chunk asked for.
    ``target`` then holds garbage.
    """
    VerifiedRead(
        fd, target, expected_key, reader=reader, expected_namespace=expected_namespace
    ).finish()
