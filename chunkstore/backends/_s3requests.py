"""S3 requests: one call with retries and backoff, batches, pages, small objects.

:class:`S3Requests` is a part of :class:`~chunkstore.backends._s3.S3Store`, mixed
in. It runs coroutines on s3fs's event loop. A request that fails for good
raises one of three exceptions here; the store's other parts catch them.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import logging
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from chunkstore.backends.base import Store
from chunkstore.errors import StoreError

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


def _bare_etag(tag: object) -> str:
    """An ETag's value without its quotes or a weak ``W/`` prefix.
    S3-compatible servers quote it in some answers and not in others.
    A header and an XML body may differ.
    So ETags are compared bare, and sent quoted as RFC 9110 writes them."""
    return str(tag).strip().removeprefix("W/").strip('"')


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


class _Failed(Exception):
    """A request failed for good (after retries, or a permanent error)."""


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


def _timestamp(value: Any) -> float:
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


class S3Requests(Store):
    """Requests of an S3 store (mixed into S3Store)."""

    if TYPE_CHECKING:  # set by S3Store
        bucket: str
        prefix: str
        max_attempts: int
        backoff: float
        max_backoff: float
        timeout: float
        concurrency: int
        failed_requests: int
        fs: Any
        _sync: Any
        _client: Any
        _rng: random.Random

        @property
        def url(self) -> str: ...
        def _full(self, name: str) -> str: ...

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

    async def _get_small(self, name: str) -> bytes | None:
        try:
            return bytes((await self._request("get_object", Key=name))["Body"])
        except (_NotFound, _Failed):
            return None

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
