"""The S3 store: chunks as objects ``<prefix>/<namespace>/ab/cd/<hex>.kvc`` through s3fs.

Requests go straight to s3fs's aiobotocore client on s3fs's event loop, in
concurrent batches. Each request is retried with jittered exponential backoff
on throttling, 5xx and timeouts; a request that still fails is a miss
(``None``/``False``) and a log line, never an exception into the serving path.
Problems that make the whole store unusable (missing bucket, bad credentials,
unreachable endpoint) raise one :class:`~chunkstore.errors.StoreError` at open.

An S3 PUT is atomic, so there are no temp objects; ``put_if_absent`` is a PUT
with ``If-None-Match: *`` (or, with ``conditional_writes=False`` for S3-compatible
servers without it, a HEAD then a PUT).

With ``data_path="nixl"`` chunk bytes move through NIXL's OBJ backend instead
(:mod:`chunkstore.backends._s3_nixl`); the same objects either way.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import datetime as _dt
import logging
import random
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from typing import Any

from chunkstore.backends import _layout as L
from chunkstore.backends._batching import (
    buffer_too_small,
    first_copies,
    read_once_per_key,
    write_once_per_key,
)
from chunkstore.backends._index import CapacityIndex
from chunkstore.backends._iopool import raise_first
from chunkstore.backends._upkeep import Upkeep
from chunkstore.backends.base import (
    UNSUPPORTED_GRACE,
    Buffer,
    ChunkInfo,
    ReadVerdict,
    Store,
    judge_oversized,
)
from chunkstore.backends.maintenance import (
    QUARANTINE_MODES,
    FileIdent,
    SetAside,
    StoredFile,
    reason_record,
)
from chunkstore.errors import (
    ConfigError,
    MissingDependency,
    StoreError,
)
from chunkstore.format import ByteRange
from chunkstore.hashing import ChunkKey, check_namespace, is_namespace
from chunkstore.units import parse_size

log = logging.getLogger(__name__)

_RETRY_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "ServiceUnavailable",
    "TooManyRequests",
}
_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
_EXISTS_CODES = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_AUTH_CODES = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "403",
    "AuthorizationHeaderMalformed",
}
_CHUNK_KEY_RE = re.compile(r"([0-9a-f]{16})/([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{64})\.kvc")


def _bare_etag(tag: object) -> str:
    """An ETag's value without its quotes (or a weak ``W/`` prefix): S3-compatible servers
    quote it in some answers and not in others (a header, an XML body), so ETags are
    compared bare and sent quoted, as RFC 9110 writes them."""
    return str(tag).strip().removeprefix("W/").strip('"')


def _chunk_key_of(rel: str) -> ChunkKey | None:
    """The key a chunk object name (relative to the prefix) stands for; None for any other
    name, or a chunk whose fan-out directories do not match it (foreign, spec 6.1)."""
    match = _CHUNK_KEY_RE.fullmatch(rel)
    if match is None or match.group(2) + match.group(3) != match.group(4)[:4]:
        return None
    return ChunkKey(bytes.fromhex(match.group(4)), match.group(1))


class _NotFound(Exception):
    def __init__(self, retried: bool = False) -> None:
        super().__init__()
        self.retried = retried
        """An earlier attempt of the same request may have reached S3 (its answer was lost)."""


class _Exists(Exception):
    def __init__(self, retried: bool = False) -> None:
        super().__init__()
        self.retried = retried
        """An earlier attempt of the same request may have reached S3 (its answer was lost)."""


_WRITER_META = "chunkstore-writer"
"""User metadata on conditional writes: a token per call, so that a retry answered 412
(or, for multipart, NoSuchUpload) can tell "my lost first attempt wrote it" from "another
writer did" (chunks of one key have the same bytes, so comparing bytes or ETags cannot)."""


class _Failed(Exception):
    """A request failed for good (after retries, or a permanent error)."""


def _import_s3fs() -> Any:
    try:
        import s3fs
    except ImportError:
        raise MissingDependency("s3:// stores need s3fs: pip install 'chunkstore[s3]'") from None
    return s3fs


def _error_code(exc: Exception) -> tuple[str, int]:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return True
    code, status = _error_code(exc) if isinstance(exc, Exception) else ("", 0)
    if code or status:
        return code in _RETRY_CODES or status >= 500 or status == 429
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - s3fs brings botocore
        return False
    if isinstance(exc, (HTTPClientError, BotoConnectionError)):  # refused, reset, timeouts
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, aiohttp.ClientError)


class S3Store(Upkeep, Store):
    """Chunks in an S3 bucket (or any S3-compatible server) under an optional prefix.

    Options: ``endpoint_url``, ``region``, ``key``/``secret``/``token``, ``anon``,
    ``profile`` (otherwise the usual AWS environment and config files);
    ``max_attempts`` and ``backoff`` (seconds, doubled per retry, jittered);
    ``timeout`` (per request, seconds); ``concurrency`` (requests in flight);
    ``multipart_threshold`` and ``part_size`` (bytes); ``conditional_writes``;
    ``quarantine`` (``move`` or ``delete``); ``track_access`` and
    ``access_resolution`` (seconds between access records of one chunk);
    ``data_path`` (``s3fs``, or ``nixl`` for NIXL's OBJ backend) and ``nixl_params``
    (extra OBJ backend parameters, strings).
    """

    kind = "s3"
    unsupported_grace: float | None = UNSUPPORTED_GRACE

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        key: str | None = None,
        secret: str | None = None,
        token: str | None = None,
        anon: bool = False,
        profile: str | None = None,
        max_attempts: int = 5,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        timeout: float = 30.0,
        concurrency: int = 32,
        multipart_threshold: int | str = 64 << 20,
        part_size: int | str = 16 << 20,
        conditional_writes: bool = True,
        quarantine: str = "move",
        track_access: bool = True,
        access_resolution: float = 3600.0,
        create: bool = True,
        verify: bool = True,
        name: str | None = None,
        data_path: str = "s3fs",
        nixl_params: dict[str, str] | None = None,
        max_bytes: int | str | None = None,
        index: Any = None,
    ) -> None:
        super().__init__(name=name, verify=verify)
        if not bucket:
            raise ConfigError("an S3 store URL needs a bucket: s3://bucket[/prefix]")
        if data_path not in ("s3fs", "nixl"):
            raise ConfigError(f"data_path must be 's3fs' or 'nixl', got {data_path!r}")
        if data_path != "nixl" and nixl_params:
            raise ConfigError("nixl_params only apply with data_path='nixl'")
        if data_path == "nixl" and anon:
            raise ConfigError("data_path='nixl' signs every request; anon=True needs 's3fs'")
        if quarantine not in QUARANTINE_MODES:
            raise ConfigError(f"quarantine must be 'move' or 'delete', got {quarantine!r}")
        if max_attempts < 1 or concurrency < 1:
            raise ConfigError("max_attempts and concurrency must be at least 1")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.max_attempts = int(max_attempts)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.timeout = float(timeout)
        self.concurrency = int(concurrency)
        self.multipart_threshold = parse_size(multipart_threshold)
        self.part_size = max(parse_size(part_size), 5 << 20)
        self.conditional_writes = conditional_writes
        self.quarantine_mode = quarantine
        self.track_access = track_access
        self.access_resolution = float(access_resolution)
        self.failed_requests = 0
        """Requests that failed for good (after retries): each became a miss."""
        self._failed_gets = 0
        self._touched: dict[ChunkKey, float] = {}
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self._rng = random.Random()
        s3fs = _import_s3fs()
        client_kwargs: dict[str, Any] = {}
        if region:
            client_kwargs["region_name"] = region
        config_kwargs = {
            "connect_timeout": min(self.timeout, 10.0),
            "read_timeout": self.timeout,
            "retries": {"total_max_attempts": 1, "mode": "standard"},  # we retry ourselves
            "max_pool_connections": max(self.concurrency, 10),
        }
        try:
            self.fs = s3fs.S3FileSystem(
                anon=anon,
                key=key,
                secret=secret,
                token=token,
                profile=profile,
                endpoint_url=endpoint_url,
                client_kwargs=client_kwargs,
                config_kwargs=config_kwargs,
                skip_instance_cache=True,
            )
            from fsspec.asyn import sync

            self._sync = sync
            self._client = sync(self.fs.loop, self.fs.set_session)
        except Exception as exc:  # noqa: BLE001 - botocore config errors have many types
            raise StoreError(f"s3://{bucket}: cannot set up the S3 client: {exc}") from None
        self.endpoint_url = endpoint_url or getattr(self._client.meta, "endpoint_url", "")
        self.data_path = data_path
        self._plane: Any = None
        self._check_open()
        if data_path == "nixl":
            self._plane = self._open_nixl(
                endpoint_url, region, key, secret, token, nixl_params or {}
            )
        self.index: CapacityIndex | None = None
        if max_bytes is not None and index is None:
            raise ConfigError(
                f"s3://{bucket}: max_bytes needs a capacity index (index='redis://host:6379/0'): "
                "an object store has no lock that its writers could share"
            )
        if index is not None:
            self.index = self._open_index(
                index, None if max_bytes is None else parse_size(max_bytes)
            )

    # --- naming and small objects (the primitives of Upkeep) ------------------------

    def _name_of(self, path: str) -> str:
        return self._relative(path)

    def _full_path(self, name: str) -> str:
        return self._full(name)

    def _chunk_path(self, key: ChunkKey) -> str:
        return self.object_key(key)

    def _exists_path(self, path: str) -> bool:
        return self._object_sizes([path])[0] is not None

    def _evict_path(self, path: str) -> int:
        """Delete the chunk object ``path`` and its access record; 1 if it was there."""
        key = _chunk_key_of(self._relative(path))
        return 0 if key is None else self.delete_many([key])

    def _read_small(self, name: str) -> bytes | None:
        """Object ``name`` under the prefix; None if missing or unreadable."""
        data: bytes | None = self._run(self._get_small, self._full(name))
        return data

    def _write_small(self, name: str, data: bytes) -> None:
        """One PUT of ``name`` under the prefix; OSError if it failed for good."""

        async def write() -> None:
            try:
                await self._request("put_object", Key=self._full(name), Body=data)
            except (_Failed, _NotFound, _Exists) as exc:
                raise OSError(str(exc)) from None

        self._run(write)

    def _open_nixl(
        self,
        endpoint_url: str | None,
        region: str | None,
        key: str | None,
        secret: str | None,
        token: str | None,
        params: dict[str, str],
    ) -> Any:
        from chunkstore.backends._s3_nixl import NixlObjConfig, NixlObjDataPath

        credentials: tuple[str, str, str | None] | None = None
        if key and secret:
            credentials = (key, secret, token)
        else:  # the same credentials the s3fs client resolved (environment, profile, ...)

            async def resolve() -> Any:
                found = await self.fs.session.get_credentials()
                return None if found is None else await found.get_frozen_credentials()

            frozen = self._run(resolve)
            if frozen is not None and frozen.access_key and frozen.secret_key:
                credentials = (frozen.access_key, frozen.secret_key, frozen.token)
        config = NixlObjConfig(
            bucket=self.bucket,
            region=region or getattr(self._client.meta, "region_name", None) or "us-east-1",
            endpoint_url=endpoint_url,
            credentials=credentials,
            max_attempts=self.max_attempts,
            threads=self.concurrency,
            params=params,
        )
        return NixlObjDataPath(
            config,
            self._object_sizes,
            where=self.url,
            probe_name=self._full(L.MARKER_NAME),
            stall_limit=max(60.0, self.timeout * self.max_attempts),
        )

    # --- naming --------------------------------------------------------------------

    @property
    def high_latency(self) -> bool:
        return True

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def object_key(self, key: ChunkKey) -> str:
        """The object name of ``key``'s chunk."""
        return f"{self.prefix}/{key.path}" if self.prefix else key.path

    def _full(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    # --- request machinery -----------------------------------------------------------

    def _run(self, coro_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return self._sync(self.fs.loop, coro_fn, *args)

    async def _request(self, op: str, **kwargs: Any) -> Any:
        """One S3 call (body read included) with retries; raises _NotFound/_Exists/_Failed."""
        kwargs.setdefault("Bucket", self.bucket)
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            try:
                return await asyncio.wait_for(self._attempt(op, kwargs), self.timeout)
            except Exception as exc:  # noqa: BLE001 - classified below
                code, status = _error_code(exc)
                if code in _MISSING_CODES or status == 404:
                    if code == "NoSuchBucket":
                        raise _Failed(f"bucket {self.bucket} does not exist") from None
                    raise _NotFound(retried=attempt > 0) from None
                if code in _EXISTS_CODES or status in (409, 412):
                    raise _Exists(retried=attempt > 0) from None
                last = exc
                if not _retryable(exc):
                    break
                if attempt + 1 < self.max_attempts:
                    delay = min(self.max_backoff, self.backoff * (2**attempt))
                    await asyncio.sleep(self._rng.uniform(delay / 2, delay))
        self.failed_requests += 1
        raise _Failed(f"{op}: {type(last).__name__}: {last}")

    async def _attempt(self, op: str, kwargs: dict[str, Any]) -> Any:
        response = await getattr(self._client, op)(**kwargs)
        body = response.get("Body") if isinstance(response, dict) else None
        if body is not None:
            try:
                response["Body"] = await body.read()
            finally:
                body.close()
        return response

    async def _gather(self, coros: Sequence[Awaitable[Any]]) -> list[Any]:
        semaphore = asyncio.Semaphore(self.concurrency)

        async def limited(coro: Awaitable[Any]) -> Any:
            async with semaphore:
                return await coro

        return list(await asyncio.gather(*(limited(c) for c in coros)))

    # --- opening -----------------------------------------------------------------------

    def _check_open(self) -> None:
        where = self.url
        prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            listing = self._run(self._open_probe, prefix)
        except Exception as exc:  # noqa: BLE001 - mapped to one clear message
            code, status = _error_code(exc)
            if code == "NoSuchBucket" or (status == 404 and not code):
                raise StoreError(f"{where}: bucket {self.bucket!r} does not exist") from None
            if code in _AUTH_CODES or status == 403:
                raise StoreError(
                    f"{where}: access denied ({code or status}); check the credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, profile, key/secret options)"
                ) from None
            name = type(exc).__name__
            if name == "NoCredentialsError":
                raise StoreError(
                    f"{where}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, a profile, or anon=True for public buckets"
                ) from None
            if _retryable(exc):
                raise StoreError(
                    f"{where}: cannot reach the S3 endpoint {self.endpoint_url}: {exc}"
                ) from None
            raise StoreError(f"{where}: cannot open: {name}: {exc}") from None
        dirs = {p["Prefix"][len(prefix) :].rstrip("/") for p in listing.get("CommonPrefixes", [])}
        files = {o["Key"][len(prefix) :] for o in listing.get("Contents", [])}
        if L.MARKER_NAME in files:
            marker = self._run(self._get_small, self._full(L.MARKER_NAME))
            if marker is not None:
                L.check_marker(marker, where)
            return
        ours = {d for d in dirs if is_namespace(d) or d == L.QUARANTINE_DIR}
        if (dirs or files) and not ours:
            raise StoreError(
                f"{where}: not a chunkstore prefix (no {L.MARKER_NAME} and no chunk "
                "directories, but other objects); use an empty or new prefix"
            )

    async def _open_probe(self, prefix: str) -> Any:
        attempts = min(self.max_attempts, 2)
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                return await asyncio.wait_for(
                    self._client.list_objects_v2(
                        Bucket=self.bucket, Prefix=prefix, Delimiter="/", MaxKeys=1000
                    ),
                    self.timeout,
                )
            except Exception as exc:  # noqa: BLE001
                last = exc
                if not _retryable(exc) or attempt + 1 == attempts:
                    raise
                await asyncio.sleep(self.backoff)
        raise last  # type: ignore[misc]  # pragma: no cover

    async def _get_small(self, name: str) -> bytes | None:
        try:
            return bytes((await self._request("get_object", Key=name))["Body"])
        except (_NotFound, _Failed):
            return None

    # --- reads -------------------------------------------------------------------------

    async def _get_one(self, key: ChunkKey) -> bytes | None:
        got = await self._get_tagged(key)
        return None if got is None else got[0]

    async def _get_tagged(
        self, key: ChunkKey, *, failure_raises: bool = False
    ) -> tuple[bytes, str] | None:
        """The object's bytes and its ETag (which object they came from); None if missing
        or unreadable (logged; StoreError instead with ``failure_raises``)."""
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
        """Reads (whole objects or byte ranges) that failed for good (after retries) other
        than by absence, NIXL transfers included: each was logged and served as a miss.
        (What tells ``verify``/``cp``/``inspect`` a chunk they could not read from one that
        vanished.)"""
        return self._failed_gets + (0 if self._plane is None else self._plane.failed_transfers)

    async def _read_many_async(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        return await self._gather([self._get_one(k) for k in keys])

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        if self._plane is not None:
            read: list[bytes | None] = self._plane.read_many([self.object_key(k) for k in keys])
            return read
        got: list[bytes | None] = self._run(self._read_many_async, keys)
        return got

    def _object_sizes(self, names: Sequence[str]) -> list[int | None]:
        """ContentLength per object (one concurrent batch of HEADs); None if missing/failed."""

        async def one(name: str) -> int | None:
            try:
                return int((await self._request("head_object", Key=name))["ContentLength"])
            except (_NotFound, _Failed, _Exists):
                return None

        async def run() -> list[int | None]:
            return await self._gather([one(n) for n in names])

        sizes: list[int | None] = self._run(run)
        return sizes

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

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Stored bytes per key, unvalidated, not recorded as an access (for verify/cp)."""
        return self._read_many(keys)

    def read_unchecked_with_idents(
        self, keys: Sequence[ChunkKey]
    ) -> list[tuple[bytes, FileIdent | None] | None]:
        """Like :meth:`read_unchecked_many`, with the ETag of the object each read came from.

        Hand it to :meth:`quarantine_if_unchanged` / :meth:`delete_if_unchanged` so that a
        maintenance tool removes the object it judged, never one a writer put in its place
        since. (Always plain GETs, also with ``data_path="nixl"``: they carry the ETag.)
        """

        async def run() -> list[tuple[bytes, str] | None]:
            return await self._gather([self._get_tagged(k) for k in keys])

        got: list[tuple[bytes, FileIdent | None] | None] = self._run(run)
        return got

    def get_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Chunk bytes per key; ``None`` for missing, corrupt or unreachable chunks.

        Up to ``concurrency`` GETs are in flight; each body is verified (on the calling
        thread, off the event loop) as soon as it has arrived, while the others download.
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
        """:meth:`get_many_into` for keys given once each; per key its size, None, or the
        ConfigError its buffer gave (raised, in order, once every buffer is filled)."""
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
        """``data`` (as :meth:`get_many` served it) into ``view``; its size. An object larger
        than ``view`` is a miss where it is damaged (judged by its header, as the filesystem
        store does, when ``verify`` is off and it was served unchecked), else ConfigError
        (the caller's buffer is too small for a whole chunk)."""
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
        for (key, data), ok in zip(items, written):
            if ok:
                self._touched.pop(key, None)
                if index is not None:
                    index.account(self.object_key(key), len(memoryview(data).cast("B")))
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
        """Quarantine (``reason`` given) or delete the object of ETag ``etag``; what came of
        it. A request that fails for good is StoreError ("not done" would read as "replaced
        meanwhile"; a read's :meth:`report_corrupt` logs it as the outcome).

        The delete is conditional on the ETag (``If-Match``; with
        ``conditional_writes=False``, a HEAD comparing ETags just before a plain DELETE), and
        so is what goes to quarantine: see :meth:`_copy_aside` and :meth:`_move_over`.
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
        """Whether a set-aside to ``dest`` that was refused (the object gone from its name,
        or the copy refused by ``If-None-Match``) lost to another run that set the same
        object aside first: quarantine now holds a copy of the key where it held none, or
        one of the ETag read. One HEAD, on this refused path only.

        Note: a copy of a multipart object has another ETag than its source, so where
        quarantine held an earlier copy such a refusal reads as "replaced or removed"; and
        a plain delete (a prune) of the object just after this store's own copy landed
        reads as another run's set-aside (the copy that stays is this store's)."""
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
        """Set ``name`` aside to ``dest``, where quarantine holds no copy of it: copy it
        there (``CopySourceIfMatch``), then delete it (conditional on ``etag``). If the
        delete is refused, another object took the key after the copy, or before it on a
        server that ignores ``CopySourceIfMatch``: the copy is removed again and the key
        keeps what the writer put there. Raises _NotFound, _Exists or _Failed when the
        object was not set aside.

        Note: with ``conditional_writes`` the copy also carries ``If-None-Match: *``, so a
        copy another reader put at ``dest`` since the caller's HEAD is never overwritten;
        without it (or on a server that ignores it) that round trip's race remains.
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
        """Set ``name`` aside to ``dest``, where quarantine holds an earlier copy of the key;
        whether its copy was written there.

        A copy made first would land on the earlier copy, and if the set-aside then did not
        happen (the object replaced meanwhile, copied anyway by a server that ignores
        ``CopySourceIfMatch``), removing that copy would lose both. So the object is read
        (its ETag compared with ``etag``), deleted on the ETag read, and only then are the
        bytes read written over the earlier copy. Raises _NotFound, _Exists or _Failed when
        the object was not set aside.

        Note: a write to quarantine that fails after the delete loses this copy of the
        damage (logged); the earlier copy stays, and so must the reason beside it.
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

    # --- listing -------------------------------------------------------------------------

    def _objects(self, sub: str) -> Iterator[dict[str, Any]]:
        """Every object under ``<prefix>/<sub>`` (paged; a failed page ends the listing)."""
        prefix = self._full(sub) if sub else (f"{self.prefix}/" if self.prefix else "")
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix, "MaxKeys": 1000}
            if token:
                kwargs["ContinuationToken"] = token
            try:
                page = self._run(self._list_page, kwargs)
            except _Failed as exc:
                raise StoreError(f"{self.url}: listing failed: {exc}") from None
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            following = page.get("NextContinuationToken")
            if not following or following == token:
                # asked again without a new token, the server would answer from the first
                # page (or this one) forever: a listing that never ends
                raise StoreError(
                    f"{self.url}: listing failed: the server marked a page truncated "
                    "without a new continuation token"
                )
            token = following

    async def _list_page(self, kwargs: dict[str, Any]) -> Any:
        try:
            return await self._request("list_objects_v2", **kwargs)
        except _NotFound:
            return {}

    def _relative(self, name: str) -> str:
        return name[len(self.prefix) + 1 :] if self.prefix else name

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        if namespace is not None:
            check_namespace(namespace)  # it becomes an object-key prefix
        pending: tuple[ChunkKey, int, float, str] | None = None
        for obj in self._objects(f"{namespace}/" if namespace else ""):
            rel = self._relative(obj["Key"])
            stamp = _timestamp(obj.get("LastModified"))
            if pending is not None:
                key, size, mtime, name = pending
                if rel == name + ".atime":  # sorts right after its chunk
                    yield ChunkInfo(key, size, mtime, max(mtime, stamp))
                    pending = None
                    continue
                yield ChunkInfo(key, size, mtime, mtime)
                pending = None
            found = _chunk_key_of(rel)
            if found is not None:
                pending = (found, int(obj.get("Size", 0)), stamp, rel)
        if pending is not None:
            key, size, mtime, _ = pending
            yield ChunkInfo(key, size, mtime, mtime)

    def foreign_files(self) -> builtins.list[StoredFile]:
        """Objects under namespace prefixes that are neither chunks nor access records."""
        out = []
        for obj in self._objects(""):
            rel = self._relative(obj["Key"])
            top = rel.split("/", 1)[0]
            if not is_namespace(top):
                continue
            if _chunk_key_of(rel.removesuffix(".atime")) is not None:
                continue
            out.append(
                StoredFile(
                    obj["Key"], top, int(obj.get("Size", 0)), _timestamp(obj.get("LastModified"))
                )
            )
        return out

    def relative_path(self, path: str) -> str:
        """A :class:`StoredFile` path as shown to a user: the whole object key."""
        return path

    def _area_files(self, area: str) -> Iterator[tuple[str, str, int, float]]:
        """Every object under ``<prefix>/<area>/``, named relative to the area."""
        for o in self._objects(f"{area}/"):
            rel = self._relative(o["Key"])[len(area) + 1 :]
            yield rel, o["Key"], int(o.get("Size", 0)), _timestamp(o.get("LastModified"))

    def _unfinished(self) -> builtins.list[StoredFile]:
        """Unfinished multipart uploads of chunks (S3's only partial writes).

        Uploads of any other name are another application's. They are never
        listed, never aborted.
        """
        prefix = f"{self.prefix}/" if self.prefix else ""

        async def page(markers: dict[str, str]) -> Any:
            return await self._request("list_multipart_uploads", Prefix=prefix, **markers)

        uploads: list[dict[str, Any]] = []
        markers: dict[str, str] = {}
        while True:  # pages of up to 1000 uploads
            try:
                listing = self._run(page, markers)
            except (_Failed, _NotFound, _Exists) as exc:
                # what the earlier pages found is still true: sweep that, warn about the rest
                if uploads:
                    log.warning(
                        "%s: multipart upload listing failed after a page: %s", self.name, exc
                    )
                break
            uploads.extend(listing.get("Uploads", []))
            following = {
                name: listing[f"Next{name}"]
                for name in ("KeyMarker", "UploadIdMarker")
                if listing.get(f"Next{name}")
            }
            if not listing.get("IsTruncated") or "KeyMarker" not in following:
                break
            if following == markers:  # a server that never moves on: take what it gave
                log.warning("%s: multipart upload listing did not advance; stopped", self.name)
                break
            markers = following
        out = []
        for upload in uploads:
            started = _timestamp(upload.get("Initiated"))
            rel = self._relative(upload["Key"])
            if _chunk_key_of(rel) is None:
                continue  # not a chunk's upload: another application's
            if upload["Key"].startswith(prefix):
                out.append(
                    StoredFile(
                        f"{upload['Key']}?uploadId={upload['UploadId']}",
                        rel.split("/", 1)[0],
                        0,
                        started,
                    )
                )
        return out

    def _drop_unfinished(self, orphan: StoredFile) -> bool:
        """Abort one multipart upload; whether that was answered."""
        name, upload_id = orphan.path.split("?uploadId=", 1)

        async def run() -> None:
            await self._request("abort_multipart_upload", Key=name, UploadId=upload_id)

        try:
            self._run(run)
        except (_Failed, _NotFound, _Exists):
            return False
        return True

    def flush(self) -> None:
        """Wait until background access records are written."""
        with self._pending_lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=self.timeout)

    def close(self) -> None:
        """Wait for background access records, then drop the connection pool."""
        self.flush()
        if self.index is not None:
            self.index.close()
        if self._plane is not None:
            self._plane.close()
        try:
            self._run(self._client.close)
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("%s: closing the S3 client failed", self.name, exc_info=True)

    def __repr__(self) -> str:
        via = ", data_path='nixl'" if self._plane is not None else ""
        return f"S3Store({self.url!r}{via})"


def _timestamp(value: Any) -> float:
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def open_s3_store(url: str, **options: Any) -> S3Store:
    """Open ``s3://bucket[/prefix]``; options as for :class:`S3Store`."""
    if not url.startswith("s3://"):
        raise ConfigError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    try:
        return S3Store(bucket, prefix, **options)
    except TypeError as exc:
        raise ConfigError(f"invalid option for an S3 store: {exc}") from None
