"""The S3 store's writes and removals: PUTs, multipart uploads, deletes, set-asides.

:class:`S3Writes` is a part of :class:`~chunkstore.backends._s3.S3Store`, mixed in.
It uses the store's own state; what it needs is declared at its top. Its
set-aside is the primitive :class:`~chunkstore.backends._upkeep.Upkeep` builds
quarantine on.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from chunkstore.backends import _layout as L
from chunkstore.backends._batching import (
    write_once_per_key,
)
from chunkstore.backends._index import CapacityIndex
from chunkstore.backends._s3requests import (
    S3Requests,
    _bare_etag,
    _Exists,
    _Failed,
    _NotFound,
    _timestamp,
)
from chunkstore.backends.base import Buffer
from chunkstore.backends.maintenance import FileIdent, SetAside, reason_record
from chunkstore.errors import StoreError
from chunkstore.format import chain_link
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)

_WRITER_META = "chunkstore-writer"
"""User metadata on conditional writes: a token per call.
A retry answered 412, or NoSuchUpload for multipart, then tells two cases apart.
Either "my lost first attempt wrote it" or "another writer did".
Chunks of one key have the same bytes, so comparing bytes or ETags cannot tell."""


class S3Writes(S3Requests):
    """Writes, deletes and set-asides of an S3 store (mixed into S3Store)."""

    if TYPE_CHECKING:  # set by S3Store and S3Reads
        conditional_writes: bool
        multipart_threshold: int
        part_size: int
        quarantine_mode: str
        index: CapacityIndex | None
        _plane: Any
        _touched: dict[ChunkKey, float]

        def object_key(self, key: ChunkKey) -> str: ...
        async def _get_tagged(
            self, key: ChunkKey, *, failure_raises: bool = False
        ) -> tuple[bytes, str] | None: ...

    # --- writes --------------------------------------------------------------------------

    async def _put_one(self, key: ChunkKey, data: Buffer, if_absent: bool) -> bool:
        name = self.object_key(key)
        view = memoryview(data).cast("B")
        body = data if isinstance(data, bytes) else view.tobytes()
        try:
            if if_absent and not self.conditional_writes:
                try:
                    await self._request("head_object", Key=name)
                    return False
                except _NotFound:
                    pass
            match: dict[str, Any] = {}
            token = ""
            if if_absent and self.conditional_writes:
                token = secrets.token_hex(8)
                match = {"IfNoneMatch": "*", "Metadata": {_WRITER_META: token}}
            if len(body) > self.multipart_threshold:
                await self._multipart(name, body, match)
            else:
                await self._request("put_object", Key=name, Body=body, **match)
            return True
        except _Exists as exc:
            return exc.retried and await self._written_by(name, token)
        except _NotFound as exc:
            if exc.retried and await self._written_by(name, token):
                return True  # a retried CompleteMultipartUpload whose first answer was lost
            log.warning("%s: put %s failed, not stored: %s", self.name, key.hex, exc)
            return False
        except _Failed as exc:
            log.warning("%s: put %s failed, not stored: %s", self.name, key.hex, exc)
            return False

    async def _written_by(self, name: str, token: str) -> bool:
        """Whether the stored object carries this call's writer token."""
        if not token:
            return False
        try:
            head = await self._request("head_object", Key=name)
        except (_NotFound, _Failed, _Exists):
            return False
        return bool(head.get("Metadata", {}).get(_WRITER_META) == token)

    async def _multipart(self, name: str, body: bytes, match: dict[str, Any]) -> None:
        match = dict(match)
        metadata = match.pop("Metadata", None)
        extra = {"Metadata": metadata} if metadata else {}
        upload = await self._request("create_multipart_upload", Key=name, **extra)
        upload_id = upload["UploadId"]
        try:
            offsets = range(0, len(body), self.part_size)

            async def part(number: int, start: int) -> dict[str, Any]:
                got = await self._request(
                    "upload_part",
                    Key=name,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=body[start : start + self.part_size],
                )
                return {"PartNumber": number, "ETag": got["ETag"]}

            parts = await self._gather([part(i + 1, s) for i, s in enumerate(offsets)])
            await self._request(
                "complete_multipart_upload",
                Key=name,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
                **match,
            )
        except BaseException:
            try:
                await self._request("abort_multipart_upload", Key=name, UploadId=upload_id)
            except (_Failed, _NotFound, _Exists):
                pass  # left for remove_orphans / the bucket's lifecycle rule
            raise

    def _put_batch(self, items: Sequence[tuple[ChunkKey, Buffer]], if_absent: bool) -> list[bool]:
        # concurrent requests must not race two copies of one key (nor HEAD-then-PUT twice)
        return write_once_per_key(
            items, lambda unique: self._put_unique(unique, if_absent), replace=not if_absent
        )

    def _put_unique(self, items: Sequence[tuple[ChunkKey, Buffer]], if_absent: bool) -> list[bool]:
        async def run() -> list[bool]:
            return await self._gather([self._put_one(k, d, if_absent) for k, d in items])

        self._ensure_marker()
        index = self.index
        if index is not None:
            fits = [index.fits(len(memoryview(d).cast("B"))) for _, d in items]
            if not all(fits):
                taken = [item for item, ok in zip(items, fits) if ok]
                done = iter(self._put_unique(taken, if_absent) if taken else [])
                return [next(done) if ok else False for ok in fits]
        if self._plane is not None and not (if_absent and self.conditional_writes):
            written = self._plane_put(items, if_absent)
        else:  # NIXL's PUT has no If-None-Match: conditional writes stay on s3fs
            written = self._run(run)
        for (key, _), ok in zip(items, written):
            if ok:
                self._touched.pop(key, None)
        if index is not None:  # the batch accounted in one round trip, after its PUTs
            index.account_many(
                [
                    (self.object_key(key), len(view), chain_link(view) or b"")
                    for (key, data), ok in zip(items, written)
                    if ok
                    for view in (memoryview(data).cast("B"),)
                ]
            )
        return written

    def _plane_put(self, items: Sequence[tuple[ChunkKey, Buffer]], if_absent: bool) -> list[bool]:
        names = [self.object_key(k) for k, _ in items]
        todo = list(range(len(items)))
        if if_absent:  # conditional_writes=False: HEAD then PUT, as on the s3fs path
            todo = [i for i, size in zip(todo, self._object_sizes(names)) if size is None]
        written = [False] * len(items)
        done = self._plane.write_many([(names[i], items[i][1]) for i in todo])
        for i, ok in zip(todo, done):
            written[i] = ok
        return written

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._put_batch(items, False)

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._replacing_unusable(items, self._put_batch(items, True))

    def _written_at(self, key: ChunkKey) -> float | None:
        async def head() -> float | None:
            try:
                found = await self._request("head_object", Key=self.object_key(key))
            except (_NotFound, _Failed, _Exists):
                return None
            return _timestamp(found.get("LastModified"))

        written: float | None = self._run(head)
        return written

    _marker_ok = False

    def _ensure_marker(self) -> None:
        if self._marker_ok:
            return

        async def write() -> None:
            try:
                await self._request(
                    "put_object",
                    Key=self._full(L.MARKER_NAME),
                    Body=L.marker_bytes(),
                    IfNoneMatch="*",
                )
            except _Exists:
                pass
            except (_Failed, _NotFound) as exc:
                log.warning("%s: cannot write the layout marker: %s", self.name, exc)

        self._run(write)
        self._marker_ok = True

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        async def one(key: ChunkKey) -> bool:
            name = self.object_key(key)
            try:
                await self._request("head_object", Key=name)
            except (_NotFound, _Failed, _Exists):
                return False
            try:
                await self._request("delete_object", Key=name)
                await self._request("delete_object", Key=name + ".atime")
            except (_NotFound, _Exists):
                pass
            except _Failed as exc:
                log.warning("%s: delete %s failed: %s", self.name, key.hex, exc)
                return False
            return True

        async def run() -> list[bool]:
            return await self._gather([one(k) for k in keys])

        for k in keys:
            self._touched.pop(k, None)
        deleted: list[bool] = self._run(run)
        if self.index is not None:
            gone = [(self.object_key(k), 0) for k, ok in zip(keys, deleted) if ok]
            self.index.removed(lambda: gone)
        return sum(deleted)

    # --- set-asides (the primitives of Upkeep) --------------------------------------

    def _suspect(self, key: ChunkKey) -> FileIdent | None:
        return None  # a read's ETag is not kept: _read_current reads it again

    def _read_current(self, key: ChunkKey) -> tuple[bytes, str] | None:
        """The object's bytes and ETag, read again (StoreError where that failed)."""
        got: tuple[bytes, str] | None = self._run(
            partial(self._get_tagged, key, failure_raises=True)
        )
        return got

    def _set_aside(self, key: ChunkKey, etag: FileIdent | None, reason: str | None) -> SetAside:
        """Quarantine or delete the object of ETag ``etag``, and return what came of it.

        A given ``reason`` quarantines, and none deletes.
        A request that fails for good raises StoreError.
        "Not done" would read as "replaced meanwhile".
        A read's :meth:`report_corrupt` logs the StoreError as the outcome.

        The delete is conditional on the ETag, with ``If-Match``.
        With ``conditional_writes=False`` a HEAD compares ETags just before a plain DELETE.
        What goes to quarantine is conditional too: see :meth:`_copy_aside` and
        :meth:`_move_over`.
        """
        name = self.object_key(key)
        move = reason is not None and self.quarantine_mode == "move"
        dest = self._full(f"{L.QUARANTINE_DIR}/{key.namespace}/{key.hex}{L.CHUNK_SUFFIX}")
        tag = None if not etag else str(etag)  # (a server that sent no ETag: nothing to compare)

        async def run() -> SetAside:
            aside = move  # whether the chunk's copy is in quarantine (its reason goes beside)
            held = True  # whether quarantine held a copy of the key before this set-aside
            try:
                if not move:
                    await self._delete_if(name, tag)
                elif await self._present(dest):
                    aside = await self._move_over(name, dest, tag)
                else:
                    held = False
                    await self._copy_aside(name, dest, tag)
            except (_NotFound, _Exists):
                # gone already (pruned, or set aside by another reader), or another object
                # is there now: what a writer put in its place stays
                if move and await self._set_aside_by_another(dest, tag, held):
                    return SetAside.TAKEN
                return SetAside.CHANGED
            except _Failed as exc:
                raise StoreError(
                    f"{self.name}: cannot set aside s3://{self.bucket}/{name}: {exc}"
                ) from None
            try:
                if aside and reason is not None:
                    await self._request(
                        "put_object", Key=dest + L.REASON_SUFFIX, Body=reason_record(reason)
                    )
                await self._request("delete_object", Key=name + ".atime")
            except (_NotFound, _Exists, _Failed) as exc:  # the chunk itself is aside
                log.debug("%s: after setting %s aside: %s", self.name, key.hex, exc)
            return SetAside.DONE

        self._touched.pop(key, None)
        result: SetAside = self._run(run)
        if result is SetAside.DONE and self.index is not None:
            self.index.removed(lambda: [(name, 0)])
        return result

    async def _set_aside_by_another(self, dest: str, etag: str | None, held: bool) -> bool:
        """Whether a refused set-aside to ``dest`` lost to another run that set it aside first.

        The refusal is the object gone from its name, or the copy refused by
        ``If-None-Match``.
        The other run won if quarantine now holds a copy of the key where it held none.
        It won too if quarantine holds a copy of the ETag read.
        This costs one HEAD, on this refused path only.

        A copy of a multipart object has another ETag than its source.
        So where quarantine held an earlier copy, such a refusal reads as "replaced or removed".
        A plain delete of the object, a prune, may come just after this store's copy landed.
        That reads as another run's set-aside. The copy that stays is this store's."""
        try:
            head = await self._request("head_object", Key=dest)
        except (_NotFound, _Exists, _Failed):
            return False  # (the outcome is "not set aside" either way: only its wording)
        return not held or (
            etag is not None and _bare_etag(head.get("ETag", "")) == _bare_etag(etag)
        )

    async def _present(self, name: str) -> bool:
        """Whether object ``name`` exists (a HEAD); raises _Failed if that cannot be told."""
        try:
            await self._request("head_object", Key=name)
        except (_NotFound, _Exists):
            return False
        return True

    async def _copy_aside(self, name: str, dest: str, etag: str | None) -> None:
        """Set ``name`` aside to ``dest``, where quarantine holds no copy of it.

        It copies the object there with ``CopySourceIfMatch``.
        It then deletes it, conditional on ``etag``.
        A refused delete means another object took the key after the copy.
        On a server that ignores ``CopySourceIfMatch``, it may have taken it before.
        The copy is then removed again, and the key keeps what the writer put there.
        Raises _NotFound, _Exists or _Failed when the object was not set aside.

        With ``conditional_writes`` the copy also carries ``If-None-Match: *``.
        So a copy another reader put at ``dest`` since the caller's HEAD is never overwritten.
        Without it, or on a server that ignores it, that round trip's race remains.
        """
        conditions: dict[str, str] = {}
        if etag is not None:
            conditions["CopySourceIfMatch"] = f'"{_bare_etag(etag)}"'
        if self.conditional_writes:
            conditions["IfNoneMatch"] = "*"
        got = await self._request(
            "copy_object", Key=dest, CopySource={"Bucket": self.bucket, "Key": name}, **conditions
        )
        copied = got.get("CopyObjectResult", {}).get("ETag")
        try:
            await self._delete_if(name, etag)
        except (_Exists, _Failed):
            if copied is not None:  # the chunk stays in place: no copy of it aside
                await self._drop_copy(dest, str(copied))
            raise

    async def _move_over(self, name: str, dest: str, etag: str | None) -> bool:
        """Set ``name`` aside to ``dest``, where quarantine holds an earlier copy of the key.

        Returns whether its copy was written there.
        A copy made first would land on the earlier copy.
        The set-aside might then not happen: the object may have been replaced meanwhile.
        A server that ignores ``CopySourceIfMatch`` would have copied it anyway.
        Removing that copy would then lose both.
        So the object is read first, and its ETag compared with ``etag``.
        It is deleted on the ETag read.
        Only then are the bytes read written over the earlier copy.
        Raises _NotFound, _Exists or _Failed when the object was not set aside.

        A write to quarantine that fails after the delete loses this copy of the damage.
        That is logged. The earlier copy stays, and so must the reason beside it.
        """
        got = await self._request("get_object", Key=name)
        read = _bare_etag(got.get("ETag", ""))
        if etag is not None and read != _bare_etag(etag):
            raise _Exists()
        await self._delete_if(name, read or None)
        try:
            await self._request("put_object", Key=dest, Body=got["Body"])
        except (_NotFound, _Exists, _Failed) as exc:
            log.warning(
                "%s: %s deleted, but its copy was not written to quarantine (an earlier copy "
                "stays there): %s",
                self.name,
                name,
                exc,
            )
            return False
        return True

    async def _delete_if(self, name: str, etag: str | None) -> None:
        """Delete ``name`` if its ETag is ``etag`` (any object when None); raises _Exists if
        another object is there, _NotFound if none is."""
        if etag is None:
            await self._request("delete_object", Key=name)
            return
        if self.conditional_writes:
            try:
                await self._request("delete_object", Key=name, IfMatch=f'"{_bare_etag(etag)}"')
            except _NotFound as exc:
                if not exc.retried:
                    raise
                # an earlier attempt's answer was lost: it deleted the object (or, if it never
                # arrived, whoever did leaves the same outcome: gone, the copy aside)
            return
        # Note: without conditional requests one HEAD's round trip remains for a writer to
        # replace the object before the DELETE lands.
        head = await self._request("head_object", Key=name)
        if _bare_etag(head.get("ETag", "")) != _bare_etag(etag):
            raise _Exists()
        await self._request("delete_object", Key=name)

    async def _drop_copy(self, dest: str, etag: str) -> None:
        """Remove the quarantine copy of ETag ``etag`` made by a set-aside that then did not
        happen (a copy another tool made since is left)."""
        try:
            await self._delete_if(dest, etag)
        except (_NotFound, _Exists, _Failed) as exc:
            log.debug("%s: quarantine copy %s left: %s", self.name, dest, exc)
