"""The S3 store's reads: GETs checked as they arrive, into buffers, ranges, access records.

:class:`S3Reads` is a part of :class:`~chunkstore.backends._s3.S3Store`, mixed in.
It uses the store's own state; what it needs is declared at its top.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chunkstore.backends import _layout as L
from chunkstore.backends._batching import (
    buffer_too_small,
    first_copies,
    read_once_per_key,
)
from chunkstore.backends._index import CapacityIndex
from chunkstore.backends._iopool import raise_first
from chunkstore.backends._s3requests import (
    S3Requests,
    _Exists,
    _Failed,
    _NotFound,
)
from chunkstore.backends.base import Buffer, ReadVerdict, judge_oversized
from chunkstore.backends.maintenance import FileIdent
from chunkstore.errors import ConfigError, StoreError
from chunkstore.format import ByteRange
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)


class S3Reads(S3Requests):
    """Reads of an S3 store (mixed into S3Store)."""

    if TYPE_CHECKING:  # set by S3Store
        track_access: bool
        access_resolution: float
        index: CapacityIndex | None
        _plane: Any
        _failed_gets: int
        _touched: dict[ChunkKey, float]
        _pending: set[concurrent.futures.Future[Any]]
        _pending_lock: threading.Lock

        def object_key(self, key: ChunkKey) -> str: ...

    # --- reads -------------------------------------------------------------------------

    async def _get_one(self, key: ChunkKey) -> bytes | None:
        got = await self._get_tagged(key)
        return None if got is None else got[0]

    async def _get_tagged(
        self, key: ChunkKey, *, failure_raises: bool = False
    ) -> tuple[bytes, str] | None:
        """The object's bytes, and its ETag, which tells the object they came from.
        None if missing or unreadable, and logged.
        With ``failure_raises`` an unreadable object raises StoreError instead."""
        name = self.object_key(key)
        try:
            got = await self._request("get_object", Key=name)
        except _NotFound:
            return None
        except (_Failed, _Exists) as exc:
            if failure_raises:
                raise StoreError(
                    f"{self.name}: cannot read s3://{self.bucket}/{name}: {exc}"
                ) from None
            self._failed_gets += 1
            log.warning("%s: get %s failed, treated as a miss: %s", self.name, key.hex, exc)
            return None
        return got["Body"], str(got.get("ETag", ""))

    @property
    def read_errors(self) -> int:
        """Reads that failed for good after retries, other than by absence.
        They count whole objects and byte ranges, NIXL transfers included.
        Each was logged and served as a miss.
        So ``verify``, ``cp`` and ``inspect`` tell an unreadable chunk from a vanished one."""
        return self._failed_gets + (0 if self._plane is None else self._plane.failed_transfers)

    async def _read_many_async(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        return await self._gather([self._get_one(k) for k in keys])

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        if self._plane is not None:
            read: list[bytes | None] = self._plane.read_many([self.object_key(k) for k in keys])
            return read
        got: list[bytes | None] = self._run(self._read_many_async, keys)
        return got

    def _checked(self, key: ChunkKey, data: Any) -> Any:
        if self._plane is None or data is None or not self.verify:
            return super()._checked(key, data)
        judgement = self._judge(key, data)
        if judgement.verdict is ReadVerdict.CORRUPT:
            # A NIXL read is a HEAD and then a GET of that many bytes: a chunk rewritten
            # in between (recompressed, another layout) reads as garbage. One whole s3fs GET
            # decides before anything is counted or quarantined.
            return super()._checked(key, self._run(self._get_one, key))
        return data if self._admit(key, judgement) else None

    def read_unchecked_with_idents(
        self, keys: Sequence[ChunkKey]
    ) -> list[tuple[bytes, FileIdent | None] | None]:
        """Like :meth:`read_unchecked_many`, with the ETag of the object each read came from.

        Hand it to :meth:`quarantine_if_unchanged` or :meth:`delete_if_unchanged`.
        A maintenance tool then removes the object it judged.
        It never removes one a writer put in its place since.
        These reads are always plain GETs, also with ``data_path="nixl"``.
        Plain GETs carry the ETag.
        """

        async def run() -> list[tuple[bytes, str] | None]:
            return await self._gather([self._get_tagged(k) for k in keys])

        got: list[tuple[bytes, FileIdent | None] | None] = self._run(run)
        return got

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Chunk bytes per key; ``None`` for missing, corrupt or unreachable chunks.

        Up to ``concurrency`` GETs are in flight.
        Each body is verified as soon as it has arrived, while the others download.
        That runs on the calling thread, off the event loop.
        """
        first = first_copies(keys)
        if len(first) < len(keys):
            # each key once: a corrupt chunk asked for twice is counted and set aside once
            got = dict(zip(first, self.get_many(list(first))))
            return [got[k] for k in keys]
        if self._plane is not None or not self.verify or len(keys) < 2:
            raw = self._read_many(keys)
            out = [self._checked(k, d) for k, d in zip(keys, raw)]  # off the event loop
        else:
            out = self._get_verified_as_they_arrive(keys)
        self._touch([k for k, d in zip(keys, out) if d is not None])
        return out

    def _get_verified_as_they_arrive(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        semaphore = asyncio.Semaphore(self.concurrency)

        async def limited(key: ChunkKey) -> bytes | None:
            async with semaphore:
                return await self._get_one(key)

        pending = {
            asyncio.run_coroutine_threadsafe(limited(key), self.fs.loop): i
            for i, key in enumerate(keys)
        }
        out: list[bytes | None] = [None] * len(keys)
        try:
            for done in concurrent.futures.as_completed(pending):
                i = pending[done]
                out[i] = self._checked(keys[i], done.result())
        except BaseException:
            for future in pending:
                future.cancel()
            raise
        return out

    def get_many_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]
    ) -> list[int | None]:
        """Batched :meth:`get_into` (concurrent GETs, each verified as it arrives); size or
        ``None`` per key."""
        if len(keys) != len(buffers):
            raise ConfigError("get_many_into needs one buffer per key")
        if self._plane is not None:
            return [self.get_into(k, b) for k, b in zip(keys, buffers)]
        views = [memoryview(b).cast("B") for b in buffers]
        for view in views:
            if view.readonly:
                raise ConfigError("get_into needs a writable buffer")
        # Each key once (a damaged object asked for twice is counted and set aside once).
        results = read_once_per_key(keys, views, self._read_into_unique)
        raise_first([got if isinstance(got, BaseException) else None for got in results])
        return results

    def _read_into_unique(self, keys: list[ChunkKey], views: list[memoryview]) -> list[Any]:
        """:meth:`get_many_into` for keys given once each.
        Per key it returns its size, None, or the ConfigError its buffer gave.
        The errors are raised in order, once every buffer is filled."""
        out: list[Any] = []
        for key, data, view in zip(keys, self.get_many(keys), views):
            try:
                out.append(None if data is None else self._copy_into(key, data, view))
            except ConfigError as exc:
                out.append(exc)
        return out

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Read the chunk into ``buffer``; its size, or None."""
        view = memoryview(buffer)
        if view.readonly:
            raise ConfigError("get_into needs a writable buffer")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        if self._plane is not None:  # straight into the caller's buffer
            try:
                size = self._plane.read_into(self.object_key(key), view)
            except ConfigError:
                # Larger than the buffer: the whole-object read below judges it (bytes
                # appended, a damaged header: a corrupt miss, set aside; else the caller's).
                return self._get_into_whole(key, view)
            if size is None:
                return None
            read = view[:size]
            checked = self._checked(key, read)
            if checked is None:
                return None
            if checked is not read:  # re-read over s3fs after a failed check (see _checked)
                if len(checked) > len(view):
                    return None
                view[: len(checked)] = checked
                size = len(checked)
            self._touch([key])
            return int(size)
        return self._get_into_whole(key, view)

    def _get_into_whole(self, key: ChunkKey, view: memoryview) -> int | None:
        """:meth:`get_into` through one verified whole-object read."""
        data = self.get(key)
        return None if data is None else self._copy_into(key, data, view)

    def _copy_into(self, key: ChunkKey, data: Any, view: memoryview) -> int | None:
        """Copy ``data``, as :meth:`get_many` served it, into ``view``. Returns its size.

        An object larger than ``view`` is a miss where it is damaged.
        When ``verify`` is off and it was served unchecked, its header judges it.
        The filesystem store does the same.
        Otherwise it raises ConfigError: the caller's buffer is too small for a whole chunk."""
        size = len(data)
        if size > len(view):
            if not self.verify and not self._admit(key, judge_oversized(key, data, size)):
                return None
            raise buffer_too_small(len(view), size)
        view[:size] = data
        return size

    def read_ranges(self, key: ChunkKey, ranges: Sequence[ByteRange]) -> list[bytes] | None:
        """Ranged GETs for each byte range (one TP rank's share); None if missing. Unchecked."""
        if self._plane is not None:
            got: list[bytes] | None = self._plane.read_ranges(
                self.object_key(key), [(r.offset, r.length) for r in ranges]
            )
            if got is not None:
                self._touch([key])
            return got

        async def fetch() -> list[bytes | None]:
            async def one(r: ByteRange) -> bytes | None:
                try:
                    got = await self._request(
                        "get_object",
                        Key=self.object_key(key),
                        Range=f"bytes={r.offset}-{r.offset + r.length - 1}",
                    )
                    return bytes(got["Body"])
                except _NotFound:
                    return None
                except (_Failed, _Exists) as exc:
                    self._failed_gets += 1
                    log.warning("%s: ranged get %s failed, a miss: %s", self.name, key.hex, exc)
                    return None

            return await self._gather([one(r) for r in ranges])

        parts: list[bytes] = self._run(fetch)
        if any(p is None or len(p) != r.length for p, r in zip(parts, ranges)):
            return None
        self._touch([key])
        return parts

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        async def one(key: ChunkKey) -> bool:
            try:
                await self._request("head_object", Key=self.object_key(key))
                return True
            except (_NotFound, _Failed, _Exists):
                return False

        async def run() -> list[bool]:
            return await self._gather([one(k) for k in keys])

        present: list[bool] = self._run(run)
        return present

    # --- access records ------------------------------------------------------------------

    def _touch(self, keys: Sequence[ChunkKey]) -> None:
        """Write access records for keys not recorded within ``access_resolution`` (in the
        background: a read never waits for its access record)."""
        if not self.track_access or not keys:
            return
        now = time.time()
        due = [k for k in keys if now - self._touched.get(k, 0.0) >= self.access_resolution]
        if not due:
            return
        if len(self._touched) > 65536:
            self._touched.clear()
        for k in due:
            self._touched[k] = now
        if self.index is not None:
            self.index.touch([self.object_key(k) for k in due])

        async def write() -> None:
            async def one(k: ChunkKey) -> None:
                try:
                    await self._request(
                        "put_object", Key=self.object_key(k) + ".atime", Body=L.access_bytes(now)
                    )
                except (_NotFound, _Failed, _Exists):
                    pass

            await self._gather([one(k) for k in due])

        future = asyncio.run_coroutine_threadsafe(write(), self.fs.loop)
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(future)
