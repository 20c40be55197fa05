"""Announce what shared stores hold, and answer "which of these chunks exist".

:class:`StoreAnnouncer` speaks for the stores themselves, not for one engine.
It lists them, and publishes the difference from its last listing. So a chunk
any writer stored is announced with ``BlockStored``. A chunk that left every
store is announced gone with ``BlockRemoved``. It may have been pruned,
deleted, or set aside as corrupt. A new announcer starts with
``AllBlocksCleared``, then announces everything listed, in pages.

Events name chunks by chunkstore's keys:

* ``block_hashes`` is the chunk's 32-byte key.
* ``parent_block_hash`` is its parent's. For a first chunk it is the namespace
  root.
* ``token_ids`` are the tokens it covers.
* ``block_size`` is their number.
* ``extra_keys`` carries ``("namespace", <16 hex digits>)``.

Keys derive from the namespace: model, LoRA and cache salt. So one tenant's
chunks never appear under another's keys. ``medium`` is ``STORAGE``,
``ownership`` ``shared``.

:class:`ChunkQuery` answers routers that ask instead of listen, over a ZeroMQ
REP socket. A request is a msgpack map
``{"namespace": str, "keys": [32-byte digests]}``. It gets
``{"exists": [bool, ...], "prefix": int}``, or ``{"error": str}``. ``prefix`` is
how many leading keys are stored. Given a ``token``, it answers only requests
whose ``"token"`` member equals it, compared in constant time; any other gets
``{"error": QUERY_REFUSED}``. Given a CurveZMQ secret key, the socket encrypts.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import blake3

from chunkstore.events._keyset import KeySet
from chunkstore.events._publisher import EventPublisher, _zmq
from chunkstore.events._wire import (
    EventBatch,
    _msgpack,
    all_blocks_cleared,
    block_removed,
    block_stored,
)
from chunkstore.hashing import DIGEST_SIZE, ChunkKey

__all__ = ["ChunkQuery", "StoreAnnouncer", "curve_public_key"]

log = logging.getLogger(__name__)

Describe = Callable[[ChunkKey], "tuple[bytes, list[int]] | None"]
"""A chunk's parent digest and token ids, read from its header (None: gone or unreadable)."""

PENDING_FOR = 5.0
"""Seconds a followed store whose header cannot be read yet is tried again (another mount
may show a new file a moment late); after that the next listing has it."""
FEED_RETRY = 1.0
"""Seconds the feed thread waits after a feed could not be read."""
MAX_QUERY_KEYS = 4096
"""Most keys one query may ask about."""
MAX_QUERY_TOKEN_BYTES = 1024
"""Longest shared secret a query socket takes."""
QUERY_REFUSED = "refused: this query socket needs its token, and the request's is missing or wrong"
"""The error a request without the right token gets."""
_NAMESPACE = re.compile(r"[0-9a-f]{16}")


class StoreAnnouncer:
    """Publishes what ``stores`` hold on ``publisher``: a listing every ``interval``
    seconds, and in between the change feed of each store that has a capacity index.

    A store with an index (``store.index.feed()``, through wrappers' ``inner``) is
    followed as its writers change it, within a round trip of the index. A feed entry that
    carries the chunk's parent and tokens, checked against its key, is announced without
    reading the chunk's header. Where the feed
    lost entries (see :mod:`chunkstore.backends._feed`), the stores are listed at once.
    A store without one is seen at the next listing. ``follow=False`` lists only.

    At most ``max_chunks`` chunks are tracked (beyond that, new ones are counted
    in :attr:`untracked`, not announced); ``page`` events go in one batch.
    """

    def __init__(
        self,
        stores: Sequence[Any],
        publisher: EventPublisher,
        describe: Describe,
        *,
        interval: float = 10.0,
        page: int = 512,
        max_chunks: int = 1_000_000,
        follow: bool = True,
    ) -> None:
        self.stores = list(stores)
        self.publisher = publisher
        self.describe = describe
        self.interval = interval
        self.page = page
        self.max_chunks = max_chunks
        self.untracked = 0
        """Chunks seen past ``max_chunks`` in the last listing. They are not announced."""
        self.followed = 0
        """Changes announced from change feeds (stores and removals)."""
        self.bad_links = 0
        """Feed entries whose parent and tokens (``d``) do not hash to their chunk's key: the
        header was read instead."""
        self.feeds = [f for f in map(_feed_of, self.stores) if f is not None] if follow else []
        """The change feeds followed, one per store with a capacity index."""
        self._held = KeySet()
        self._started = False
        self._lock = threading.Lock()  # _held, _touched, and the order of what is published
        # Keys a feed changed while a listing ran: the feed is newer, so the listing's
        # difference leaves them alone.
        self._touched: KeySet | None = None
        # Stored keys whose header could not be read yet (another mount may show a new
        # file a moment later), with when to give up on them: the listing has them then.
        self._pending: dict[ChunkKey, float] = {}
        self._stop = threading.Event()
        self._rescan = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def held(self) -> int:
        """Chunks announced as stored, and not since as removed."""
        return len(self._held)

    def scan(self) -> tuple[int, int]:
        """List the stores once and publish the change; (stored, removed) announced."""
        with self._lock:
            self._touched = KeySet()
        try:
            return self._scan()
        finally:
            with self._lock:
                self._touched = None

    def _scan(self) -> tuple[int, int]:
        listed = KeySet()
        untracked = 0
        for store in self.stores:
            for info in store.list():
                if info.key in listed:
                    continue
                if len(listed) >= self.max_chunks:
                    untracked += 1
                    continue
                listed.add(info.key)
        self.untracked = untracked
        with self._lock:
            if not self._started:
                self._started = True
                self._publish([all_blocks_cleared()])
            touched = self._touched or KeySet()
            new = listed.minus(self._held, touched)
            gone = self._held.minus(listed, touched)
        described = [(key, self.describe(key)) for key in new]
        with self._lock:
            touched = self._touched or KeySet()
            events: list[dict[str, Any]] = []
            stored = removed = 0
            for key, found in described:
                if found is None or key in touched or key in self._held:
                    continue
                events.append(_stored(key, *found))
                self._held.add(key)
                stored += 1
            for key in gone:
                if key in touched or key not in self._held:
                    continue
                events.append(_removed(key))
                self._held.discard(key)
                removed += 1
            self._publish_pages(events)
        return stored, removed

    def follow(self, timeout: float = 0.1) -> int:
        """Read each change feed once (waiting up to ``timeout`` seconds in all) and publish
        what changed; how many events went out. A feed that lost entries has the stores
        listed at once (on the listing thread, or by the next :meth:`scan`)."""
        changes: list[tuple[bool, ChunkKey]] = []
        links: dict[ChunkKey, bytes] = {}
        for feed in self.feeds:
            read = feed.read(timeout / len(self.feeds))
            if read.gap:
                self._rescan.set()
            changes += read.changes
            links.update(read.links)
        now = time.monotonic()
        final: dict[ChunkKey, bool] = dict.fromkeys(self._due(now), True)
        for stored, key in changes:  # in order: the last change of a key is its state
            final.pop(key, None)
            final[key] = stored
        with self._lock:
            if self._touched is not None:
                self._touched.update(final)
            todo = [
                (key, stored)
                for key, stored in final.items()
                if stored != (key in self._held)
                and not (stored and len(self._held) >= self.max_chunks)
            ]
        described = {
            key: self._from_link(key, links.get(key)) or self.describe(key)
            for key, stored in todo
            if stored
        }
        with self._lock:
            events: list[dict[str, Any]] = []
            for key, stored in todo:
                if stored and key not in self._held:
                    found = described[key]
                    if found is None:
                        self._pending.setdefault(key, now + PENDING_FOR)
                        continue
                    self._pending.pop(key, None)
                    events.append(_stored(key, *found))
                    self._held.add(key)
                elif not stored and key in self._held:
                    self._pending.pop(key, None)
                    events.append(_removed(key))
                    self._held.discard(key)
            self._publish_pages(events)
            self.followed += len(events)
        return len(events)

    def _from_link(self, key: ChunkKey, link: bytes | None) -> tuple[bytes, list[int]] | None:
        """The parent and tokens a feed entry's ``link`` gives for ``key``, if it is what the
        key hashes (so no header need be read); None without one, or for one that is not
        (counted in :attr:`bad_links`: the header is read instead)."""
        if link is None:
            return None
        whole = len(link) >= DIGEST_SIZE and (len(link) - DIGEST_SIZE) % 4 == 0
        if not whole or blake3.blake3(link).digest() != key.digest:
            self.bad_links += 1
            return None
        count = (len(link) - DIGEST_SIZE) // 4
        return link[:DIGEST_SIZE], list(struct.unpack_from(f"<{count}I", link, DIGEST_SIZE))

    def _due(self, now: float) -> list[ChunkKey]:
        """Pending stored keys to describe again; those past their time are dropped."""
        with self._lock:
            for key in [k for k, until in self._pending.items() if until < now]:
                del self._pending[key]
            return list(self._pending)

    def _publish_pages(self, events: list[dict[str, Any]]) -> None:
        for start in range(0, len(events), self.page):
            self._publish(events[start : start + self.page])

    def _publish(self, events: list[dict[str, Any]]) -> None:
        self.publisher.publish(EventBatch(time.time(), events))

    def start(self) -> StoreAnnouncer:
        """Scan now, then list every ``interval`` seconds and follow the change feeds, each
        on a thread, until :meth:`close`."""
        self.scan()
        targets = [("chunkstore-store-announcer", self._run)]
        if self.feeds:
            targets.append(("chunkstore-store-feed", self._follow))
        for name, target in targets:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self._rescan.wait(self.interval)
            self._rescan.clear()
            if self._stop.is_set():
                return
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - a failing listing is retried next time
                continue

    def _follow(self) -> None:
        while not self._stop.is_set():
            errors = sum(feed.errors for feed in self.feeds)
            try:
                self.follow()
            except Exception:  # noqa: BLE001 - a failing header read is retried next time
                log.exception("store announcer: following the change feeds failed")
                self._stop.wait(FEED_RETRY)
                continue
            if sum(feed.errors for feed in self.feeds) > errors:
                self._stop.wait(FEED_RETRY)  # a feed is down: do not spin on it

    def close(self) -> None:
        self._stop.set()
        self._rescan.set()
        for thread in self._threads:
            thread.join(self.interval + 5)


def _removed(key: ChunkKey) -> dict[str, Any]:
    return block_removed([key.digest], "STORAGE", ownership="shared")


def _stored(key: ChunkKey, parent: bytes, tokens: list[int]) -> dict[str, Any]:
    return block_stored(
        [key.digest],
        parent,
        tokens,
        len(tokens),
        "STORAGE",
        extra_keys=[("namespace", key.namespace)],
        ownership="shared",
    )


class ChunkQuery:
    """Answers batch existence queries about ``store`` on a REP socket at ``endpoint``.

    With ``token`` (a shared secret, at most :data:`MAX_QUERY_TOKEN_BYTES`), only requests
    carrying it as ``"token"`` are answered. With ``curve_secret`` (a CurveZMQ secret key,
    40 Z85 characters) the socket speaks CurveZMQ: requests, tokens and answers are
    encrypted, and only clients that know :attr:`curve_public` can connect.
    """

    def __init__(
        self,
        store: Any,
        endpoint: str,
        *,
        token: bytes | str | None = None,
        curve_secret: bytes | None = None,
    ) -> None:
        self._token: bytes | None = None
        """The token's SHA-256: what a request's token is compared with."""
        if token is not None:
            secret = _token_bytes(token)
            if not 0 < len(secret) <= MAX_QUERY_TOKEN_BYTES:
                raise ValueError(f"a query token is 1 to {MAX_QUERY_TOKEN_BYTES} bytes")
            self._token = hashlib.sha256(secret).digest()
        zmq = _zmq()
        self._zmq = zmq
        self.store = store
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.curve_public: bytes | None = None
        """The server's CurveZMQ public key (Z85) clients need; None without CurveZMQ."""
        if curve_secret is not None:
            self.curve_public = curve_public_key(curve_secret)
            self._sock.curve_secretkey = curve_secret
            self._sock.curve_server = True
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 + MAX_QUERY_KEYS * 40 + MAX_QUERY_TOKEN_BYTES)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """The bound address."""
        self.errors = 0
        """Requests refused: malformed, or with too many keys."""
        self.refused = 0
        """Requests refused for want of the right token."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chunkstore-query", daemon=True)
        self._thread.start()

    def answer(self, request: bytes) -> dict[str, Any]:
        """The reply to one request. It is also what the socket sends."""
        try:
            body = _query_map(request)
        except ValueError as exc:
            self.errors += 1
            return {"error": str(exc)}
        if self._token is not None and not self._authentic(body.get("token")):
            self.refused += 1
            return {"error": QUERY_REFUSED}
        try:
            keys = _query_keys(body)
        except ValueError as exc:
            self.errors += 1
            return {"error": str(exc)}
        exists = [bool(x) for x in self.store.exists_many(keys)] if keys else []
        prefix = 0
        for found in exists:
            if not found:
                break
            prefix += 1
        return {"exists": exists, "prefix": prefix}

    @property
    def needs_token(self) -> bool:
        """Whether requests must carry the token."""
        return self._token is not None

    def _authentic(self, given: Any) -> bool:
        """Whether ``given`` is the token. Digests of equal length are compared in constant
        time, so neither the token's bytes nor its length show in the time taken."""
        assert self._token is not None
        if not isinstance(given, (bytes, str)):
            return False
        return hmac.compare_digest(hashlib.sha256(_token_bytes(given)).digest(), self._token)

    def _run(self) -> None:
        pack = _msgpack().packb
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            request = self._sock.recv()
            self._sock.send(pack(self.answer(request), use_bin_type=True))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


def _feed_of(store: Any) -> Any:
    """The change feed of ``store``'s capacity index (through wrappers), or None."""
    while store is not None:
        index = getattr(store, "index", None)
        if index is not None and hasattr(index, "feed"):
            return index.feed()
        store = getattr(store, "inner", None)
    return None


def curve_public_key(secret: bytes) -> bytes:
    """The CurveZMQ public key (Z85) of ``secret``; ``ValueError`` for anything but a
    secret key of 40 Z85 characters, or where this libzmq has no CurveZMQ."""
    zmq = _zmq()
    if not zmq.has("curve"):
        raise ValueError("this libzmq was built without CurveZMQ")
    if len(secret) != 40:
        raise ValueError("a CurveZMQ secret key is 40 Z85 characters")
    try:
        return bytes(zmq.curve_public(secret))
    except (zmq.ZMQError, ValueError) as exc:
        raise ValueError(f"not a CurveZMQ secret key: {exc}") from None


def _token_bytes(token: bytes | str) -> bytes:
    return token.encode() if isinstance(token, str) else bytes(token)


def _query_map(request: bytes) -> dict[Any, Any]:
    """The map a query is; ``ValueError`` for anything else."""
    try:
        body = _msgpack().unpackb(request, raw=False)
    except Exception:  # noqa: BLE001 - malformed input is one error
        raise ValueError("a query is a msgpack map") from None
    if not isinstance(body, dict):
        raise ValueError("a query is a msgpack map")
    return body


def _query_keys(body: dict[Any, Any]) -> list[ChunkKey]:
    """The keys a query names; ``ValueError`` for anything but the grammar."""
    namespace, digests = body.get("namespace"), body.get("keys")
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ValueError("namespace must be 16 lower-case hex digits")
    if not isinstance(digests, list) or len(digests) > MAX_QUERY_KEYS:
        raise ValueError(f"keys must be a list of at most {MAX_QUERY_KEYS} digests")
    if not all(isinstance(d, bytes) and len(d) == 32 for d in digests):
        raise ValueError("every key is a 32-byte digest")
    return [ChunkKey(d, namespace) for d in digests]
