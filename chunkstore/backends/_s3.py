"""The S3 store: chunks as objects ``<prefix>/<namespace>/ab/cd/<hex>.kvc`` through s3fs.

Requests go straight to s3fs's aiobotocore client on s3fs's event loop, in concurrent batches.
Each request is retried with jittered exponential backoff on throttling, 5xx and timeouts.
A request that still fails is a miss, ``None`` or ``False``, and a log line.
It is never an exception into the serving path.
Some problems make the whole store unusable: a missing bucket, bad credentials, an
unreachable endpoint.
They raise one :class:`~chunkstore.errors.StoreError` at open.

An S3 PUT is atomic, so there are no temp objects.
``put_if_absent`` is a PUT with ``If-None-Match: *``.
Some S3-compatible servers lack it. With ``conditional_writes=False`` it is a HEAD, then a PUT.

With ``data_path="nixl"`` chunk bytes move through NIXL's OBJ backend instead.
See :mod:`chunkstore.backends._s3_nixl`. The objects are the same either way.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import logging
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

from chunkstore.backends import _layout as L
from chunkstore.backends._index import CapacityIndex, shard_of
from chunkstore.backends._s3reads import S3Reads
from chunkstore.backends._s3requests import (
    _AUTH_CODES,
    S3Requests,
    _error_code,
    _Exists,
    _Failed,
    _NotFound,
    _retryable,
    _timestamp,
)
from chunkstore.backends._s3writes import S3Writes
from chunkstore.backends._upkeep import Upkeep
from chunkstore.backends.base import (
    UNSUPPORTED_GRACE,
    ChunkInfo,
    Store,
)
from chunkstore.backends.maintenance import (
    QUARANTINE_MODES,
    StoredFile,
)
from chunkstore.errors import (
    ConfigError,
    MissingDependency,
    StoreError,
)
from chunkstore.hashing import ChunkKey, check_namespace, is_namespace
from chunkstore.units import parse_size

log = logging.getLogger(__name__)

DELETE_BATCH = 500
"""Victims one DeleteObjects request deletes, with their access records: S3's 1,000 keys."""

_CHUNK_KEY_RE = re.compile(r"([0-9a-f]{16})/([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{64})\.kvc")


def _chunk_key_of(rel: str) -> ChunkKey | None:
    """The key a chunk object name, relative to the prefix, stands for.
    None for any other name.
    None too for a chunk whose fan-out directories do not match it: a foreign file, spec 6.1."""
    match = _CHUNK_KEY_RE.fullmatch(rel)
    if match is None or match.group(2) + match.group(3) != match.group(4)[:4]:
        return None
    return ChunkKey(bytes.fromhex(match.group(4)), match.group(1))


def _import_s3fs() -> Any:
    try:
        import s3fs
    except ImportError:
        raise MissingDependency("s3:// stores need s3fs: pip install 'chunkstore[s3]'") from None
    return s3fs


class S3Store(S3Reads, S3Writes, S3Requests, Upkeep, Store):
    """Chunks in an S3 bucket, or any S3-compatible server, under an optional prefix.

    Options:

    * ``endpoint_url``, ``region``, ``key``, ``secret``, ``token``, ``anon``, ``profile``.
      Otherwise the usual AWS environment and config files apply.
    * ``max_attempts`` and ``backoff``, in seconds, doubled per retry and jittered.
    * ``timeout``, per request, in seconds.
    * ``concurrency``: requests in flight.
    * ``multipart_threshold`` and ``part_size``, in bytes.
    * ``conditional_writes``.
    * ``quarantine``: ``move`` or ``delete``.
    * ``track_access``, and ``access_resolution``: seconds between access records of a chunk.
    * ``data_path``: ``s3fs``, or ``nixl`` for NIXL's OBJ backend.
    * ``nixl_params``: extra OBJ backend parameters, as strings.
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

    _has_ctime = False
    """Objects show no ctime: victims are checked against the capacity index instead."""

    def _exists_path(self, path: str) -> bool:
        return self._object_sizes([path])[0] is not None

    def _evict_path(self, path: str) -> int:
        """Delete the chunk object ``path`` and its access record; 1 if it was there."""
        key = _chunk_key_of(self._relative(path))
        return 0 if key is None else self.delete_many([key])

    def _evict_victim(self, path: str, chosen_at: float, recorded: bool) -> tuple[bool, int]:
        """Delete a victim the capacity index chose (see :meth:`_evict_paths`). An object
        shows no ctime, so it goes whatever ``chosen_at`` says; the index was asked instead
        whether a writer stored it again. Its access record goes whatever ``recorded`` says
        (a delete of an absent object costs no more than the one request carrying both)."""
        del chosen_at, recorded
        return bool(self._evict_path(path)), 0

    def _evict_paths(self, paths: builtins.list[str]) -> int:
        """Delete the chunk objects ``paths`` (victims the capacity index took out) and
        their access records: :data:`DELETE_BATCH` chunks to one DeleteObjects request, with
        no HEAD first. S3 does not tell a deleted object from an absent one, so each victim
        whose delete did not fail counts; that count is returned."""
        for path in paths:
            key = _chunk_key_of(self._relative(path))
            if key is not None:
                self._touched.pop(key, None)

        async def batch(part: builtins.list[str]) -> int:
            objects = [{"Key": p} for p in part] + [{"Key": p + ".atime"} for p in part]
            try:
                answer = await self._request(
                    "delete_objects", Delete={"Objects": objects, "Quiet": True}
                )
            except (_Failed, _NotFound, _Exists) as exc:
                log.warning("%s: deleting %d victims failed: %s", self.name, len(part), exc)
                return 0
            failed = {error.get("Key") for error in answer.get("Errors", [])}
            for error in answer.get("Errors", [])[:1]:
                log.warning("%s: cannot delete %s: %s", self.name, error.get("Key"), error)
            return sum(1 for p in part if p not in failed)

        async def run() -> builtins.list[int]:
            parts = [paths[i : i + DELETE_BATCH] for i in range(0, len(paths), DELETE_BATCH)]
            return await self._gather([batch(part) for part in parts])

        return sum(self._run(run)) if paths else 0

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

    # --- listing -------------------------------------------------------------------------

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

    def _foreign(self, shard: tuple[int, int] | None = None) -> builtins.list[StoredFile]:
        """Objects under namespace prefixes that are neither chunks nor access records (of
        shard ``(i, n)``: by the fan-out prefix they sit under; a listing of the whole
        prefix, filtered)."""
        out = []
        for obj in self._objects(""):
            rel = self._relative(obj["Key"])
            top = rel.split("/", 1)[0]
            if not is_namespace(top):
                continue
            if _chunk_key_of(rel.removesuffix(".atime")) is not None:
                continue
            if shard is not None and shard_of(rel, shard[1]) != shard[0]:
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

    def _unfinished(self, shard: tuple[int, int] | None = None) -> builtins.list[StoredFile]:
        """Unfinished multipart uploads of chunks (S3's only partial writes), of shard
        ``(i, n)`` by the chunk's name.

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
            if shard is not None and shard_of(rel, shard[1]) != shard[0]:
                continue
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


def open_s3_store(url: str, **options: Any) -> S3Store:
    """Open ``s3://bucket[/prefix]``; options as for :class:`S3Store`."""
    if not url.startswith("s3://"):
        raise ConfigError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    try:
        return S3Store(bucket, prefix, **options)
    except TypeError as exc:
        raise ConfigError(f"invalid option for an S3 store: {exc}") from None
