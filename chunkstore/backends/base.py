"""The store interface: what every tier (memory, filesystem, S3, peers) promises.

A store maps :class:`~chunkstore.hashing.ChunkKey` to the bytes of one chunk file.
The abstract methods are batched because every real backend is faster per key in batches.
Examples are one directory walk, concurrent S3 requests and one peer round trip.
Single-key conveniences are built on them here.

Every implementation keeps these contracts.
The conformance suite in ``chunkstore.testing.store_suite`` checks them.

* A missing key is ``None`` or ``False``, never an exception.
* One rule, :func:`judge`, says what a read does with the bytes it got.
  See :class:`ReadVerdict`.
  A corrupt chunk read through :meth:`Store.get_many` is a miss and is never returned.
  It is counted in ``corrupt_detected`` and handed to :meth:`Store._quarantine`.
  A chunk a newer chunkstore wrote is a plain miss, left where it is.
* ``put`` is atomic: a reader sees the old state or the whole new chunk.
  Two writers of the same key never produce a torn chunk.
* ``put_if_absent`` writes only when the key is absent and says whether this
  call wrote it.
"""

from __future__ import annotations

import builtins
import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from chunkstore.errors import (
    AuthenticationError,
    FormatError,
    LayoutError,
    SpecMismatch,
    StoreError,
    TruncatedChunk,
    UnsupportedVersion,
)
from chunkstore.format import ByteRange, ChunkHeader, check_identity, decode_chunk, read_header
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)

UNSUPPORTED_GRACE = 3600.0
"""Default :attr:`Store.unsupported_grace` of shared stores: an hour.
A rolling upgrade leaves a newer writer's chunk unread by newer readers for far less."""

Buffer = Any
"""Anything exposing the buffer protocol (bytes, bytearray, memoryview, numpy array, mmap)."""


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """One stored chunk, as listed."""

    key: ChunkKey
    """Its key (namespace included)."""
    size: int
    """Bytes stored."""
    mtime: float
    """Last write, seconds since the epoch."""
    atime: float
    """Last read as tracked by the store (not the filesystem's atime), seconds since the epoch."""


class ReadVerdict(enum.Enum):
    """What a read does with the bytes it got (spec/FORMAT.md section 2)."""

    OK = "ok"
    """A valid chunk, the one asked for: serve it."""
    UNSUPPORTED = "unsupported"
    """Written by a newer chunkstore: :class:`~chunkstore.errors.UnsupportedVersion` and its
    subclasses.
    A plain miss, not counted and never quarantined. It is intact for newer readers."""
    REFUSED = "refused"
    """Intact but not for this reader: a miss that leaves the stored copy alone.
    :class:`~chunkstore.errors.SpecMismatch` means another model.
    :class:`~chunkstore.errors.AuthenticationError` means no valid MAC for its key.
    Only readers that ask for a fingerprint or a MAC meet it."""
    CORRUPT = "corrupt"
    """Damaged bytes (every other :class:`~chunkstore.errors.FormatError`): a miss, counted,
    and quarantined or deleted as the store's policy says."""


def verdict_of(error: FormatError) -> ReadVerdict:
    """The verdict on a chunk whose check raised ``error``."""
    if isinstance(error, UnsupportedVersion):
        return ReadVerdict.UNSUPPORTED
    if isinstance(error, (SpecMismatch, AuthenticationError)):
        return ReadVerdict.REFUSED
    return ReadVerdict.CORRUPT


@dataclass(frozen=True, slots=True)
class Judgement:
    """The verdict on one read, with the error behind it."""

    verdict: ReadVerdict
    """What the read does with the bytes."""
    error: FormatError | None = None
    """Why the bytes are not served, for logs and quarantine records. ``None`` when OK."""
    header: ChunkHeader | None = None
    """The validated header, when :func:`judge` found the chunk OK."""

    def __post_init__(self) -> None:
        if (self.error is None) != (self.verdict is ReadVerdict.OK):
            raise ValueError("a judgement carries an error exactly when its verdict is not OK")

    @classmethod
    def of(cls, error: FormatError) -> Judgement:
        """The judgement on a chunk whose check raised ``error``.
        It is for a reader that validates as it reads, rather than through :func:`judge`."""
        return cls(verdict_of(error), error)

    @property
    def ok(self) -> bool:
        """Whether the bytes may be served."""
        return self.verdict is ReadVerdict.OK


def judge(
    key: ChunkKey,
    data: Any,
    *,
    mac_key: bytes | None = None,
    expected_fingerprint: bytes | None = None,
) -> Judgement:
    """Check ``data`` as the chunk stored under ``key``.
    It checks structure, checksum and key, and the MAC and model fingerprint where given.
    It never raises a format error: every defect is a verdict.
    An OK judgement carries the validated header."""
    try:
        chunk = decode_chunk(
            data,
            expected_key=key.digest,
            expected_namespace=key.namespace,
            mac_key=mac_key,
            expected_fingerprint=expected_fingerprint,
        )
    except FormatError as exc:
        return Judgement.of(exc)
    return Judgement(ReadVerdict.OK, header=chunk.header)


def judge_oversized(key: ChunkKey, head: Any, size: int) -> Judgement:
    """Judge a stored chunk of ``size`` bytes too large for its buffer, from its header alone.

    ``head`` is the file's first bytes, at least the whole header.
    The verdict is not OK where the header shows damage.
    Damage is bytes appended after the payload, a truncated payload, a damaged header,
    or another key's chunk.
    It is OK for a whole chunk that the caller's buffer is too small for.
    That is the caller's mistake, not a miss.

    Every store judges an oversized chunk, with or without ``verify``.
    It uses this function, or the full check of bytes it read whole.
    A local file uses its header only, as does any store without ``verify``.
    Damaged bytes are a miss, never an exception, however large.
    A file of any size may sit under a chunk's name."""
    try:
        header = read_header(head)
        declared = header.data_offset + header.stored_size
        if declared < size:
            raise LayoutError(f"{size - declared} trailing bytes after the payload")
        if declared > size:
            raise TruncatedChunk(
                f"payload has {size - header.data_offset} of {header.stored_size} bytes"
            )
        check_identity(header, key.digest, None, key.namespace)  # after the sizes, as a sized read
    except FormatError as exc:
        return Judgement.of(exc)
    return Judgement(ReadVerdict.OK, header=header)


SetAsideRunner = Callable[[Callable[[], None]], str | None]
"""Takes the set-aside of one corrupt chunk, and runs it or has it run.
The set-aside is a call that quarantines the chunk and logs what became of it.
It never raises.
The runner returns ``None`` once it has taken it, else why it will not run it.
The chunk is then left where it is."""

_set_aside_runner: ContextVar[SetAsideRunner | None] = ContextVar("set_aside_runner", default=None)


@contextmanager
def set_asides_handed_to(runner: SetAsideRunner) -> Iterator[None]:
    """Inside the block, hand this thread's corrupt chunks to ``runner``.

    A chunk any store reports through :meth:`Store.report_corrupt` is counted at once.
    :meth:`Store._admit` reports that way too.
    ``runner`` then sets it aside. Other threads are not affected.

    This is for a caller that judges a store's chunk on its own thread.
    It must not wait for the store's set-aside, which is I/O on that store and may stall.
    That I/O is a rename on a mount, or requests to S3 or a peer.
    The tiered store hands it to the tier's guard.
    It is a context variable, not a parameter, so every store's own ``_admit`` runs unchanged.
    Its counters and log lines stay the same."""
    token = _set_aside_runner.set(runner)
    try:
        yield
    finally:
        _set_aside_runner.reset(token)


class Store(ABC):
    """Abstract chunk store. Subclasses implement the ``_``-prefixed batched primitives."""

    #: Short label for metrics and logs (``"fs"``, ``"s3"``, ``"memory"``, ``"peer"``).
    kind: str = "store"

    def __init__(self, *, name: str | None = None, verify: bool = True) -> None:
        self.name = name or self.kind
        self.verify = verify
        self._corrupt = 0
        self._corrupt_lock = threading.Lock()

    # --- capabilities -----------------------------------------------------------

    @property
    def supports_listing(self) -> bool:
        """Whether :meth:`list` enumerates everything stored."""
        return True

    @property
    def atomic_put(self) -> bool:
        """Whether a reader can never observe a partially written chunk."""
        return True

    @property
    def high_latency(self) -> bool:
        """True for stores where each request costs a round trip (S3, peers):
        :meth:`lookup_prefix` then binary-searches instead of asking for every key."""
        return False

    @property
    def corrupt_detected(self) -> int:
        """How many corrupt chunks reads have found so far.
        Each was a miss. Each was set aside unless replaced or removed since the read.
        See :meth:`report_corrupt`."""
        return self._corrupt

    # --- primitives ------------------------------------------------------------

    @abstractmethod
    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Raw stored bytes per key, ``None`` where absent. No validation."""

    @abstractmethod
    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of each key."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        """Store each chunk atomically, overwriting. True per item that was written."""

    @abstractmethod
    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        """Store each chunk unless its key exists. True per item this call wrote."""

    @abstractmethod
    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        """Delete keys, ignoring missing ones. Returns how many were deleted."""

    @abstractmethod
    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        """Every stored chunk (of one namespace, if given), in no particular order."""

    def close(self) -> None:  # noqa: B027 - optional hook: stores without resources need nothing
        """Release connections and flush. The store is unusable afterwards."""

    # --- keys held by chunks this reader cannot use (spec section 6.7) --------------

    unsupported_grace: float | None = None
    """Seconds after its write that :meth:`put_if_absent` may replace a chunk this store
    cannot use.
    Such a chunk is unsupported, corrupt, or fails its MAC.
    ``None`` means never, for a store that keeps no write times.
    Stores shared by many writers set ``UNSUPPORTED_GRACE``."""

    def _written_at(self, key: ChunkKey) -> float | None:
        """When the chunk stored under ``key`` was written, in seconds since the epoch.
        ``None`` if it is absent or the store cannot tell."""
        return None

    def _replaces_unusable(self, key: ChunkKey) -> bool:
        """Whether :meth:`put_if_absent` may overwrite the chunk that holds ``key``.

        It may when this store cannot use the chunk and it was written more than
        :attr:`unsupported_grace` ago.
        Without this, a chunk of an unknown major would keep its key a miss for good.
        Such a chunk is a bit flip of its version digit, or a planted file.
        It is never quarantined, and put-if-absent never replaces it.
        What replaces it is a chunk every later reader reads, see spec section 2.8.
        This costs a stat on every collision.
        It reads the chunk only when it is older than the grace."""
        grace = self.unsupported_grace
        if grace is None:
            return False
        written = self._written_at(key)
        if written is None or time.time() - written <= grace:
            return False
        data = self.read_unchecked_many([key])[0]
        if data is None:
            return False
        judgement = self._judge(key, data)
        if judgement.verdict in (ReadVerdict.UNSUPPORTED, ReadVerdict.CORRUPT):
            return True
        return isinstance(judgement.error, AuthenticationError)

    def _replacing_unusable(
        self, items: Sequence[tuple[ChunkKey, Buffer]], written: builtins.list[bool]
    ) -> builtins.list[bool]:
        """``written`` (a put-if-absent's results), with each item whose key holds a chunk
        :meth:`_replaces_unusable` allows overwriting written over it."""
        for index, done in enumerate(written):
            key = items[index][0]
            if not done and self._replaces_unusable(key):
                log.info(
                    "%s: replacing the unusable chunk %s (older than the grace)", self.name, key.hex
                )
                written[index] = self.put_many([items[index]])[0]
        return written

    def _quarantine(self, key: ChunkKey, reason: str) -> str:
        """Move a corrupt chunk out of the serving path. Returns what became of it, for the log.
        Raises StoreError where that failed. The default deletes it."""
        return "deleted" if self.delete_many([key]) else "already gone"

    # --- validated reads ---------------------------------------------------------

    def get_many(self, keys: Sequence[ChunkKey]) -> builtins.list[bytes | None]:
        """Chunk bytes per key. ``None`` for missing chunks, and for corrupt ones, quarantined."""
        raw = self._read_many(keys)
        return [self._checked(k, d) for k, d in zip(keys, raw)]

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> builtins.list[bytes | None]:
        """Stored bytes per key with no validation, no quarantine and no access-time update.

        It is for maintenance tools such as verify, cp and inspect.
        They must not disturb the LRU order that ``prune --max-bytes`` relies on.
        Stores that track access times override this. The default is the raw read.
        """
        return self._read_many(keys)

    def _checked(self, key: ChunkKey, data: Any) -> Any:
        """``data`` if it may be served as ``key``'s chunk, else ``None`` (verdict acted on)."""
        if data is None or not self.verify:
            return data
        return data if self._admit(key, self._judge(key, data)) else None

    def _judge(self, key: ChunkKey, data: Any) -> Judgement:
        """How this store checks bytes it read. Hook: a store that knows its model or MAC
        key asks :func:`judge` for them too."""
        return judge(key, data)

    def _admit(self, key: ChunkKey, judgement: Judgement) -> bool:
        """Act on a read's verdict; True only when the bytes may be served.

        Corrupt chunks are counted and quarantined by :meth:`report_corrupt`.
        Two kinds of chunk are misses that touch nothing.
        One is a newer chunkstore's chunk, as in a rolling upgrade sharing this store.
        The other is one refused as not ours.
        Quarantining them would destroy a cache that is good for its own readers.
        Stores extend this to count or log verdicts their way.
        """
        if judgement.error is not None and judgement.verdict is ReadVerdict.CORRUPT:
            self.report_corrupt(key, judgement.error)
        return judgement.ok

    def report_corrupt(self, key: ChunkKey, exc: Exception) -> None:
        """Count a corrupt chunk and quarantine it. Never raises.

        One warning names the chunk and says what became of it.
        It is logged once the set-aside has been tried, so it never claims one that did
        not happen.
        Inside :func:`set_asides_handed_to` the chunk is counted here.
        The runner sets it aside later."""
        with self._corrupt_lock:
            self._corrupt += 1
        runner = _set_aside_runner.get()
        if runner is None:
            self._set_aside_reported(key, exc)
            return
        refused = runner(lambda: self._set_aside_reported(key, exc))
        if refused is not None:
            log.warning(
                "%s: corrupt chunk %s (%s): not set aside: %s", self.name, key.hex, exc, refused
            )

    def _set_aside_reported(self, key: ChunkKey, exc: Exception) -> None:
        """Quarantine a chunk :meth:`report_corrupt` counted, and log what became of it.
        Never raises."""
        try:
            outcome = self._quarantine(key, f"{type(exc).__name__}: {exc}")
        except StoreError as failure:
            outcome = f"not set aside: {failure}"
        except Exception:  # noqa: BLE001 - quarantine is best effort; the read is a miss anyway
            log.exception(
                "%s: corrupt chunk %s (%s): not set aside, unexpected error",
                self.name,
                key.hex,
                exc,
            )
            return
        log.warning("%s: corrupt chunk %s (%s): %s", self.name, key.hex, exc, outcome)

    # --- single-key conveniences ---------------------------------------------------

    def get(self, key: ChunkKey) -> bytes | None:
        """One chunk's bytes or ``None``."""
        return self.get_many([key])[0]

    def exists(self, key: ChunkKey) -> bool:
        """Whether one key is stored."""
        return self.exists_many([key])[0]

    def put(self, key: ChunkKey, data: Buffer) -> bool:
        """Store one chunk."""
        return self.put_many([(key, data)])[0]

    def put_if_absent(self, key: ChunkKey, data: Buffer) -> bool:
        """Store one chunk unless present. True if this call wrote it."""
        return self.put_if_absent_many([(key, data)])[0]

    def delete(self, key: ChunkKey) -> bool:
        """Delete one key. True if it existed."""
        return self.delete_many([key]) == 1

    # --- prefix lookup -------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys of a chain are present.

        Low-latency stores ask for all keys in one batch.
        High-latency stores rely on chains being monotone in practice, and binary-search.
        A chunk is stored only after its prefix.
        The search takes at most ceil(log2(n)) + 2 requests.
        """
        if not keys:
            return 0
        if not self.high_latency:
            present = self.exists_many(keys)
            for i, hit in enumerate(present):
                if not hit:
                    return i
            return len(keys)
        return binary_search_prefix(keys, lambda k: self.exists_many([k])[0])

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def binary_search_prefix(keys: Sequence[ChunkKey], present: Any) -> int:
    """Length of the present prefix, assuming presence is monotone along the chain.

    Checks the last key first, so a full hit costs one request.
    Then it checks the first, so a full miss costs two.
    Then it bisects: ceil(log2(n)) + 2 requests at most.
    """
    n = len(keys)
    if present(keys[n - 1]):
        return n
    if not present(keys[0]):
        return 0
    lo, hi = 1, n - 1  # keys[lo-1] present, keys[hi] absent
    while lo < hi:
        mid = (lo + hi) // 2
        if present(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


@runtime_checkable
class SupportsGetInto(Protocol):
    """Fast path: read a chunk straight into a caller buffer (a host-pool slot)."""

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Fill ``buffer`` with the chunk and return its size, or ``None`` if missing/corrupt."""
        ...


@runtime_checkable
class SupportsRangedRead(Protocol):
    """Fast path: read only some byte ranges of a chunk (one TP rank's share)."""

    def read_ranges(self, key: ChunkKey, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        """The bytes of each range, or ``None`` if the chunk is missing. Not checksummed:
        the caller verifies against the full chunk when it needs to."""
        ...


@runtime_checkable
class SupportsGetManyInto(Protocol):
    """Fast path: read a batch of chunks into caller buffers with several reads in flight."""

    def get_many_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]
    ) -> list[int | None]:
        """Fill ``buffers[i]`` with ``keys[i]``'s chunk.
        Returns per key its size, or ``None`` if missing or corrupt.
        Every read has ended on return, and no buffer is written any more."""
        ...


class PinnedChunk(Protocol):
    """A pin on one slot (a host cache's lease): ``view`` stays valid and unchanged until the
    pin is given back."""

    @property
    def view(self) -> memoryview:
        """The pinned bytes."""
        ...


@runtime_checkable
class SupportsPinning(Protocol):
    """Fast path: chunks can be pinned in place and read as stable buffers.
    A host cache over a fixed-slot pool is such a store.
    A peer server hands such buffers to NIXL without a copy."""

    def acquire(self, key: ChunkKey) -> PinnedChunk | None:
        """Pin ``key``. ``None`` if absent.
        Returns an object whose ``view`` holds exactly the chunk's bytes.
        It stays valid and unchanged until :meth:`release`."""
        ...

    def release(self, lease: Any) -> None:
        """Undo one :meth:`acquire`. Idempotent."""
        ...


@runtime_checkable
class SupportsMemoryRegions(Protocol):
    """The memory every pinned buffer lies in, for registration with a transfer engine
    (NIXL) once at start."""

    def memory_regions(self) -> Sequence[Any]:
        """Buffers that contain every view :meth:`SupportsPinning.acquire` and
        :meth:`SupportsReserve.reserve` return.
        They are numpy arrays, memoryviews or mmaps, and never move or shrink."""
        ...


@runtime_checkable
class SupportsReserve(Protocol):
    """Fast path: incoming chunks can be written straight into a slot (no staging copy)."""

    def reserve(self, key: ChunkKey) -> PinnedChunk | None:
        """A pinned writable slot for ``key``, or ``None`` when there is no room.
        Its ``view`` spans the whole slot.
        Readers do not see it until :meth:`commit`."""
        ...

    def commit(self, lease: Any, length: int | None = None) -> None:
        """Publish ``length`` bytes of a reserved slot."""
        ...

    def abort(self, lease: Any) -> None:
        """Give a reserved slot back without publishing it."""
        ...


@runtime_checkable
class SupportsModelRecords(Protocol):
    """Small per-model records beside the chunks, in ``.chunkstore/models/<fingerprint>.json``.
    They say which model a fingerprint names, see :mod:`chunkstore.backends._models`."""

    def read_model_record(self, fingerprint: bytes) -> bytes | None:
        """The record stored for ``fingerprint``, or ``None``."""
        ...

    def write_model_record(self, fingerprint: bytes, record: bytes) -> None:
        """Store or replace the record for ``fingerprint``. Raises ``StoreError`` on failure."""
        ...
