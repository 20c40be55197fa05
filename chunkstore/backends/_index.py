"""Capacity index of a shared store in Redis or Valkey: usage and LRU order, no lock.

A store shared by many machines (a mount, a bucket) cannot hold a cap with a lock file:
every capped writer of the cluster would wait its turn on the metadata server. Here the
agreement lives in a server built for it (spec/FORMAT.md section 6.8):

- a hash of the store's usage (``bytes``, ``chunks``);
- a sorted set of chunk names scored by last use, and a hash of their sizes;
- each change is one Lua script, so two writers never pick the same victim and the
  counters never drift from the set.

The files stay the truth. A capped writer reserves room for several chunks at once, a
credit counted in usage, and deletes the victims that make it; it publishes its chunks into
that room with no round trip, and accounts them after the fact, many in one script. It
gives back what is left when it closes; a writer not seen for :data:`CREDIT_GRACE` is taken
as dead and its credit given back by the next writer that asks for credit, or a reconcile.
A writer killed anywhere in between leaves a difference that
:meth:`CapacityIndex.reconcile` repairs from a walk of the files. When the server is down,
writes and reads go on (a warning, :attr:`CapacityIndex.errors`), the index is marked stale
when it answers again, and the next reconcile restores the cap.
"""

from __future__ import annotations

import array
import collections
import concurrent.futures
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from chunkstore.backends._capacity import Usage
from chunkstore.backends._index_scripts import (
    ACCOUNT,
    ADD_FOUND,
    CLEAR_STALE,
    CREDIT,
    EVICT,
    GIVE_BACK,
    RECLAIM,
    RECORD,
    REMOVE,
    REMOVE_GONE,
)
from chunkstore.errors import ConfigError, MissingDependency, StoreError

if TYPE_CHECKING:
    from chunkstore.backends._feed import ChangeFeed

log = logging.getLogger(__name__)

RETRY_AFTER = 5.0
"""Seconds an index that failed is left alone before the next try (writes go on)."""
SOCKET_TIMEOUT = 2.0
"""Seconds one request to the index may take before it counts as failed."""
MAX_VICTIMS = 256
"""Chunks one admit may evict (a chunk as large as the cap evicts at most this many)."""
EVICT_WORKERS = 8
"""Victims one index deletes at a time, once a delete is slow (:data:`SLOW_DELETE`). Such a
delete waits on a server (a network filesystem's metadata, an object store), so the deletes
of one eviction overlap; each is the same delete as alone. See "Sharing across machines" in
docs/benchmarks.md for the unlink floor."""
SLOW_DELETE = 0.0002
"""Seconds a victim's delete may take and the next still run in the same thread. A local
unlink takes tens of microseconds, less than handing it to another thread costs; past this,
the rest of the victims go :data:`EVICT_WORKERS` at a time."""
RESERVATION_GRACE = 3600.0
"""Seconds a one-chunk reservation (what writers of an earlier reading of spec 6.8 make)
whose file is not published is left alone by a reconcile: its writer may still be writing
the temp file. Older, its writer is taken as dead and the entry is taken out."""
CREDIT_CHUNKS = 16
"""Chunks of room one credit request reserves, at most: one round trip in this many puts."""
CREDIT_SHARE = 16
"""One credit request asks for at most this fraction of the cap (1/16)."""
CREDIT_TOTAL_SHARE = 4
"""The credit all writers of a store hold is at most this fraction of the cap (1/4), but for
one chunk's room per writer: credit is counted in usage, so it takes room from chunks. Past
it, a credit request gets only the room its next chunk needs."""
SPARE_WINDOW = 60.0
"""Seconds after which a victim left in place once (its file changed after the choice) may
be left again: chosen again sooner, it is deleted. So a ctime clock running ahead of this
machine's, which makes every file look changed after the choice, costs one extra account a
victim, not an eviction that never ends."""
MAX_SPARED = 4096
"""Most victims one index leaves in place within :data:`SPARE_WINDOW`; beyond that, victims
are deleted whatever their ctime."""
CREDIT_GRACE = 60.0
"""Seconds, by the index server's clock, after a writer's last credit request or account
after which its credit is given back: the writer is taken as dead. A live writer that idles
longer finds its credit gone; it then counts its chunks in full and asks anew."""
SEND_DELAY = 0.01
"""Seconds an account or touch waits at least for a credit request or flush to share its
round trip. A writer that runs low on credit asks sooner, so both go as one pipeline."""
SEND_DELAY_MOST = 0.05
"""Seconds an account or touch waits at most. Past :data:`SEND_DELAY` it goes as soon as
:data:`SEND_MIN` requests are queued: a slow writer (many machines' writers on a network
filesystem) then sends a few accounts a round trip, not one, and a fast one is not held."""
SEND_MIN = 8
"""Accounts and touched chunks queued that go without waiting for :data:`SEND_DELAY_MOST`."""
ACCOUNT_CHUNKS = 250
"""Chunks one account script call holds: one script keeps the server busy while it runs."""
BATCH = 1000
"""Repairs a reconcile sends in one script call (one round trip), and entries it checks
against the files before it takes the missing ones out in one call; also the most requests
the accounting thread sends in one pipeline."""


_FANOUT = re.compile(r"[0-9a-f]{2}")

_WAITED_ON = frozenset({"credit", "flush"})
"""Requests a caller waits on: the accounting thread sends them at once."""


@dataclass(frozen=True, slots=True)
class Reconciled:
    """What one reconcile pass changed in the index."""

    walked: int
    """Chunk files the walk found (in this shard)."""
    added: int
    """Chunks on disk the index lacked, now added."""
    removed: int
    """Index entries whose files were gone, now taken out."""


def connect(url: str) -> Any:
    """A Redis client for ``url`` (``redis://``, ``rediss://``, ``unix://``; Valkey speaks
    the same protocol). Raises :class:`MissingDependency` without the ``redis`` package."""
    try:
        import redis
    except ImportError as exc:
        raise MissingDependency(
            "a capacity index needs the redis package: pip install 'chunkstore[peer]'"
        ) from exc
    try:
        return redis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT
        )
    except ValueError as exc:
        raise ConfigError(f"capacity index URL {url!r}: {exc}") from None


def open_index(
    index: Any, marker: bytes | None, max_bytes: int | None, **hooks: Any
) -> CapacityIndex:
    """The capacity index ``index`` (a URL or a client) of the store whose layout marker is
    ``marker``, with the store's ``hooks`` (see :class:`CapacityIndex`)."""
    if marker is None:
        raise StoreError(f"{hooks.get('label', 'store')}: no layout marker to name its index by")
    client = connect(index) if isinstance(index, str) else index
    return CapacityIndex(client, store_identity(marker), max_bytes, **hooks)


class CapacityIndex:
    """The cap, usage and LRU order of one store, kept in Redis; see the module docstring.

    Offers what a :class:`~chunkstore.backends._capacity.CapacityLimiter` offers
    (:meth:`admit`, :meth:`removed`, :meth:`usage`, :meth:`recount`), with no lock: a
    writer's publish, accounting and eviction never wait for another writer.

    ``name_of(path)`` gives a chunk's name in the index (relative to the store's root, so
    that every mount of one volume agrees) and ``path_of(name)`` inverts it.
    ``evict(path, chosen_at, recorded)`` deletes a victim (a chunk the index took out in a
    step sent at ``chosen_at``) and, where ``recorded`` says the index knew of one, its
    access record, unless its file changed since; it returns
    ``(deleted, kept)``, ``kept`` being the size of a file so left in place (else 0), which
    the index then accounts again. ``evict_many(paths)``, where a store has it, deletes
    many in fewer requests, with no such check, and returns how many went.
    ``scan()`` yields ``(path, size, access_time, recorded)`` for every chunk (of one shard,
    given ``shard=(i, n)``), ``recorded`` saying an access record lies beside its file;
    ``exists(path)`` says whether a chunk file is there. ``ask_back``, for
    a store whose files show no ctime, has each batch of victims checked against the index
    before the deletes: one back in the LRU order stays.
    """

    def __init__(
        self,
        client: Any,
        store_id: str,
        max_bytes: int | None,
        *,
        name_of: Callable[[str], str],
        path_of: Callable[[str], str],
        evict: Callable[[str, float, bool], tuple[bool, int]],
        evict_many: Callable[[list[str]], int] | None = None,
        scan: Callable[[tuple[int, int] | None], Iterable[tuple[str, int, float, bool]]],
        exists: Callable[[str], bool],
        label: str = "store",
        ask_back: bool = False,
    ) -> None:
        self.client = client
        self.max_bytes = max_bytes
        self.store_id = store_id
        # One hash tag: the keys of one store share a Redis Cluster slot, as the scripts need.
        prefix = f"chunkstore:{{{store_id}}}"
        self._keys = (
            f"{prefix}:usage",
            f"{prefix}:lru",
            f"{prefix}:sizes",
            f"{prefix}:reserved",
            f"{prefix}:feed",
            f"{prefix}:records",
        )
        # with the credit each writer holds, and when each was last seen (server's clock)
        self._credit_keys = (*self._keys, f"{prefix}:credit", f"{prefix}:writers")
        self._meta = f"{prefix}:meta"
        self._name_of = name_of
        self._path_of = path_of
        self._evict = evict
        self._evict_many = evict_many
        self._scan = scan
        self._exists = exists
        self._label = label
        self._ask_back = ask_back
        self._account = client.register_script(ACCOUNT)
        self._credit_script = client.register_script(CREDIT)
        self._give_back = client.register_script(GIVE_BACK)
        self._reclaim = client.register_script(RECLAIM)
        self._add_found = client.register_script(ADD_FOUND)
        self._remove = client.register_script(REMOVE)
        self._remove_gone = client.register_script(REMOVE_GONE)
        self._evict_script = client.register_script(EVICT)
        self._clear_stale = client.register_script(CLEAR_STALE)
        self._record = client.register_script(RECORD)
        self._lock = threading.Lock()
        # This writer's credit (see reserve): its name in the index, the bytes of room it
        # holds and has not drawn yet, whether a credit request is on its way, and the puts
        # waiting for one (each its size and future).
        self._writer = uuid.uuid4().hex[:16]
        self._credit = 0
        self._asking = False
        self._asked = False  # ever: close gives back what is left
        # A credit request or an account that drew on credit failed: the server's entry for
        # this writer no longer matches what it holds. It is given back before the next
        # credit request, and what was drawn is the next reconcile's to count.
        self._forget = False
        self._waiting: collections.deque[tuple[int, concurrent.futures.Future[int]]] = (
            collections.deque()
        )
        # Accounting runs beside the writer, on one thread of the index's own: credit
        # requests (and the victims' deletes), accounts, touches. Requests queue up in
        # order; the thread sends what is queued in one pipeline (see _drain).
        self._behind: concurrent.futures.ThreadPoolExecutor | None = None
        # Victims are deleted up to EVICT_WORKERS at a time (started on first use).
        self._deleters: concurrent.futures.ThreadPoolExecutor | None = None
        self._queued: collections.deque[tuple[Any, ...]] = collections.deque()
        self._draining = False
        self._waited_on = 0  # queued requests in _WAITED_ON
        self._weight = 0  # accounts and touched chunks queued
        self._since = 0.0  # when the oldest request queued was queued (monotonic)
        self._wake = threading.Event()  # set while one is queued, or the index closes
        self._closing = False
        self._down_until = 0.0
        self._missed = False
        self.errors = 0
        """Requests to the index that failed (each a write or read that went on without it)."""
        self.evicted = 0
        """Chunks this process evicted."""
        self.kept = 0
        """Victims this process left in place: their file changed after the index chose them
        (a put replaced it, or a read recorded a use), and they were accounted again; or,
        where files show no ctime, the index had them again (a writer stored and accounted
        them since)."""
        # Victims left in place, with when (monotonic), oldest first: at most once each
        # within SPARE_WINDOW, and at most MAX_SPARED in it.
        self._spared: dict[str, float] = {}

    # --- talking to the server -----------------------------------------------------

    def _call(self, what: str, call: Callable[[], Any], requests: int = 1) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, None)`` when the index is down or failed now.

        A failure is logged and counted (as ``requests`` requests: a pipeline's), the index
        is left alone for :data:`RETRY_AFTER` seconds, and the first call that succeeds
        after it marks the index stale: the changes made meanwhile are the next
        reconcile's to count.
        """
        import redis

        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                self._missed = True
                self.errors += requests
                return False, None
        try:
            if self._missed:
                # a new value each time: a reconcile under way keeps it (see reconcile)
                self.client.hset(self._meta, "stale", repr(time.time()))
            result = call()
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                self._down_until = time.monotonic() + RETRY_AFTER
                self._missed = True
                self.errors += requests
            log.warning(
                "%s: capacity index unreachable (%s: %s); writes go on, the cap is restored by "
                "the next reconcile",
                self._label,
                what,
                exc,
            )
            return False, None
        with self._lock:
            self._missed = False
        return True, result

    # --- the limiter's interface ---------------------------------------------------

    def reserve(self, final: str, size: int) -> concurrent.futures.Future[int]:
        """Room for a chunk of ``size`` bytes about to be published at ``final``, drawn from
        this writer's credit. The future's result: the bytes drawn (0 when the index is
        down, or with no cap: there is no room to make).

        With credit enough, the future is done at once. Otherwise, and when the credit runs
        low, the index's own thread asks for more (one script: counted in usage, the least
        recently used chunks taken out) and deletes the victims; the writer writes its temp
        file meanwhile. Hand the future to :meth:`admit`, or to :meth:`release` if the chunk
        is not published after all. Only for chunks that :meth:`fits`."""
        reserved: concurrent.futures.Future[int] = concurrent.futures.Future()
        if self.max_bytes is None:
            reserved.set_result(0)
            return reserved
        with self._lock:
            if not self._waiting and self._credit >= size:
                self._credit -= size
                reserved.set_result(size)
                low = self._credit < self._grant(size) // 2
            else:
                self._waiting.append((size, reserved))
                low = True
            ask = low and not self._asking
            self._asking = self._asking or ask
        if ask:
            try:
                self._queue("credit", size)
            except BaseException as exc:  # no later put may wait behind this one
                for future in self._drop_waiting():
                    future.set_exception(exc)
                raise
        return reserved

    def _drop_waiting(self) -> list[concurrent.futures.Future[int]]:
        """Take every put waiting for credit off the queue (no request is on its way for
        them any more) and return their futures, for the caller to fail."""
        with self._lock:
            self._asking = False
            waiters = [future for _, future in self._waiting]
            self._waiting.clear()
        return waiters

    def _grant(self, size: int) -> int:
        """Bytes of room one credit request asks for, for chunks of about ``size`` bytes."""
        assert self.max_bytes is not None
        return max(size, min(CREDIT_CHUNKS * size, self.max_bytes // CREDIT_SHARE))

    def admit(
        self,
        final: str,
        size: int,
        publish: Callable[[], bool],
        *,
        replace: bool,
        reserved: concurrent.futures.Future[int] | None = None,
        link: bytes = b"",
    ) -> bool:
        """Publish a chunk of ``size`` bytes at ``final`` once its room is made
        (:meth:`reserve`, done here unless ``reserved`` gives its future), then account it
        after the fact, with the other accounts queued (no round trip to wait on). So the
        chunks on disk stay within what usage counts, accounted chunks and credit.

        Returns what ``publish`` returned, or False for a chunk larger than the cap.
        ``publish`` returns False only when a file is at ``final`` already (a put-if-absent
        that lost): that file is accounted in the chunk's place, not taken out. ``link`` (the
        chunk's parent digest and token bytes, see :func:`chunkstore.format.chain_link`)
        goes onto the change feed with the account, for readers that announce the chunk.
        """
        del replace  # publish() decides; the index learns the outcome either way
        if reserved is None:
            if not self.fits(size):
                return False
            reserved = self.reserve(final, size)
        drawn = reserved.result()  # the room is made: the victims are gone
        try:
            written = publish()
        except BaseException:
            self.release(final, reserved)
            raise
        # Published, or another writer's file is there: either way a chunk is on disk, so
        # into the LRU order. Taking the entry out would drop the winner's chunk.
        self._queue("account", self._name_of(final), size, drawn, link)
        return written

    def release(self, final: str, reserved: concurrent.futures.Future[int]) -> None:
        """Give the room reserved for a chunk that was not published (a write that failed)
        back to this writer's credit."""
        del final  # the room was never the chunk's own
        try:
            drawn = reserved.result()
        except Exception:  # noqa: BLE001 - no room was drawn; the write's own error stands
            return
        if drawn:
            with self._lock:
                self._credit += drawn

    # --- the accounting thread -----------------------------------------------------

    def _queue(self, *request: Any) -> None:
        """Queue ``request`` for the index's own thread (started here when it is idle)."""
        with self._lock:
            if not self._queued:
                self._since = time.monotonic()
            self._queued.append(request)
            self._weight += _weight(request)
            if request[0] in _WAITED_ON:
                self._waited_on += 1
                self._wake.set()
            if self._draining:
                return  # the running drain takes it
            if self._behind is None:
                self._behind = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"{self._label}-index"
                )
            try:
                self._behind.submit(self._drain)
            except RuntimeError:  # the interpreter is shutting down
                self._weight -= _weight(self._queued.pop())
                raise
            self._draining = True

    def _drain(self) -> None:
        """Send what is queued, in order, :data:`BATCH` requests to a pipeline (one round
        trip), until nothing is left. The puts a credit request serves are settled as
        soon as its victims are deleted, before the next request's victims. Requests no
        one waits on wait :data:`SEND_DELAY` for one someone does, then until
        :data:`SEND_MIN` are queued, :data:`SEND_DELAY_MOST` at most."""
        while True:
            self._wake.wait(SEND_DELAY)
            with self._lock:
                if not self._queued:
                    self._draining = False
                    return
                if (
                    not self._waited_on
                    and not self._closing
                    and self._weight < SEND_MIN
                    and time.monotonic() - self._since < SEND_DELAY_MOST
                ):
                    continue  # a few more may share the round trip
                batch: list[tuple[Any, ...]] = []
                weight = 0
                while self._queued and weight < BATCH:
                    request = self._queued.popleft()
                    batch.append(request)
                    weight += _weight(request)
                    if request[0] in _WAITED_ON:
                        self._waited_on -= 1
                self._weight -= weight
                self._since = time.monotonic()
                if not self._waited_on and not self._closing:
                    self._wake.clear()
            try:
                self._send(batch)
            except BaseException as exc:  # no writer is left waiting on a bug
                log.exception("%s: capacity index accounting failed", self._label)
                waiters: list[concurrent.futures.Future[Any]] = list(self._drop_waiting())
                for request in batch:
                    waiting = request[-1]
                    if isinstance(waiting, concurrent.futures.Future):
                        waiters.append(waiting)
                for waiting in waiters:
                    if not waiting.done():
                        waiting.set_exception(exc)
                if not isinstance(exc, Exception):
                    with self._lock:
                        self._draining = False  # the next request starts a drain anew
                    raise

    def _send(self, batch: list[tuple[Any, ...]]) -> None:
        requests = _grouped([r for r in batch if r[0] != "flush"])
        with self._lock:
            forget = self._forget and any(r[0] == "credit" for r in requests)
        if forget:  # first, so that the credit asked for now is all the server counts
            requests.insert(0, ("give back",))
        for i, request in enumerate(requests):
            if request[0] == "credit":  # at least enough for every put waiting on it
                with self._lock:
                    needed = max(sum(size for size, _ in self._waiting) - self._credit, 0)
                requests[i] = ("credit", max(self._grant(request[1]), needed), needed)
        sent = time.time()  # no later than the steps choose their victims
        results = self._pipelined(requests) if requests else []
        lost = any(
            result is None
            and (r[0] == "credit" or (r[0] == "accounts" and any(c[2] for c in r[1])))
            for r, result in zip(requests, results)
        )
        with self._lock:
            if forget and results[0] is not None:
                self._forget = False
            if lost:
                self._credit = 0
                self._forget = True
        for request, result in zip(requests, results):
            if request[0] == "credit":
                self._credited(result, sent)
            elif request[0] == "accounts" and result is not None:
                self._delete(result[2:], sent)
                if int(result[0]):  # the credit drawn had been given back: ask anew
                    with self._lock:
                        self._credit = 0
        for request in batch:
            if request[0] == "flush":
                request[1].set_result(None)

    def _credited(self, result: list[Any] | None, sent: float) -> None:
        """Settle a credit request's outcome (the bytes reserved, then the victims): delete
        its victims, add the room to this writer's credit and hand it to the puts waiting, in
        order; ask again for those it does not cover. With the index down (``result`` None),
        the puts go on with none. ``sent``: when the request was sent."""
        if result is not None:
            self._delete(result[1:], sent)
        ready: list[tuple[concurrent.futures.Future[int], int]] = []
        with self._lock:
            self._asking = False
            self._asked = True
            if result is not None:
                self._credit += int(result[0])
            while self._waiting and (result is None or self._credit >= self._waiting[0][0]):
                size, future = self._waiting.popleft()
                drawn = 0 if result is None else size
                self._credit -= drawn
                ready.append((future, drawn))
            again = self._waiting[0][0] if self._waiting else 0
            self._asking = bool(again)
        for future, drawn in ready:
            future.set_result(drawn)
        if again:
            self._queue("credit", again)

    def _pipelined(self, requests: list[tuple[Any, ...]]) -> list[Any]:
        """Each request's result from one pipeline, None where it failed."""
        from redis.exceptions import NoScriptError

        def stage(pipe: Any, request: tuple[Any, ...]) -> None:
            kind = request[0]
            if kind == "accounts":
                pipe.evalsha(
                    self._account.sha, 8, *self._credit_keys, *self._account_args(request[1])
                )
            elif kind == "give back":
                pipe.evalsha(self._give_back.sha, 8, *self._credit_keys, self._writer)
            elif kind == "credit":
                assert self.max_bytes is not None
                most = self.max_bytes // CREDIT_TOTAL_SHARE
                wanted, needed = request[1], request[2]
                args = (self._writer, wanted, needed, self.max_bytes, MAX_VICTIMS, CREDIT_GRACE)
                pipe.evalsha(self._credit_script.sha, 8, *self._credit_keys, *args, most)
            elif kind == "record":
                pipe.evalsha(self._record.sha, 2, self._keys[2], self._keys[5], *request[1])
            else:  # touch
                pipe.zadd(self._keys[1], dict.fromkeys(request[1], request[2]), xx=True, gt=True)

        def run(todo: list[tuple[Any, ...]]) -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for request in todo:
                stage(pipe, request)
            return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

        def send() -> list[Any]:
            results = run(requests)
            unknown = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if unknown:  # a server that has not seen the scripts yet (or restarted)
                self._load_scripts()
                for i, result in zip(unknown, run([requests[i] for i in unknown])):
                    results[i] = result
            return results

        weight = sum(len(r[1]) if r[0] == "accounts" else 1 for r in requests)
        ok, results = self._call("account", send, weight)
        if not ok:
            return [None] * len(requests)
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            with self._lock:
                self._missed = True  # the next call marks the index stale
                self.errors += len(failed)
            log.warning(
                "%s: capacity index refused %d requests: %s", self._label, len(failed), failed[0]
            )
        return [None if isinstance(r, Exception) else r for r in results]

    def _account_args(self, chunks: Sequence[tuple[str, int, int, bytes]]) -> list[Any]:
        """The account script's arguments for ``chunks``, each ``(name, size, drawn, link)``."""
        cap = -1 if self.max_bytes is None else self.max_bytes
        writer = self._writer if self.max_bytes is not None else ""
        args: list[Any] = [writer, cap, MAX_VICTIMS * len(chunks), time.time()]
        for chunk in chunks:
            args += chunk
        return args

    def _load_scripts(self) -> None:
        scripts = (self._account, self._credit_script, self._give_back, self._record)
        pipe = self.client.pipeline(transaction=False)
        for script in scripts:
            pipe.script_load(script.script)
        for script, sha in zip(scripts, pipe.execute()):
            script.sha = sha

    def flush(self) -> None:
        """Wait until every request submitted so far is sent: the chunks published so far
        are accounted and their victims deleted."""
        with self._lock:
            if self._behind is None:
                return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue("flush", done)
        done.result()

    def close(self) -> None:
        """Finish the accounting under way and stop its thread."""
        with self._lock:
            behind, self._behind = self._behind, None
            self._closing = True  # what is queued goes now, with no delay
            self._wake.set()
        if behind is not None:
            behind.shutdown(wait=True)
        with self._lock:
            deleters, self._deleters = self._deleters, None
            asked, self._asked = self._asked, False
            self._credit = 0
            self._closing = False
        if deleters is not None:
            deleters.shutdown(wait=True)
        if asked:  # what is left of the credit goes back to the store's room
            self._call("give back", partial(self._give_back, self._credit_keys, [self._writer]))

    def fits(self, size: int) -> bool:
        """Whether one chunk of ``size`` bytes may be stored at all (not larger than the cap)."""
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning(
                "chunk of %d bytes exceeds the store cap of %d; not stored", size, self.max_bytes
            )
            return False
        return True

    def account_many(self, published: Sequence[tuple[str, int, bytes]]) -> list[bool]:
        """Count the chunks just published, each ``(path, size, link)`` (``link`` as for
        :meth:`admit`, or empty), in one pipeline (one round trip per :data:`BATCH`), and
        delete the least recently used chunks the index chose to bring usage back under the
        cap. For each chunk: True if the index had no entry for it before; False if it had,
        or is down."""
        new: list[bool] = []
        for start in range(0, len(published), BATCH):
            part = published[start : start + BATCH]
            requests = _grouped(
                [("account", self._name_of(p), size, 0, link) for p, size, link in part]
            )
            sent = time.time()
            results = self._pipelined(requests)
            victims = [victim for out in results if out is not None for victim in out[2:]]
            self._delete(victims, sent)
            for request, out in zip(requests, results):
                flags = b"0" * len(request[1]) if out is None else _as_bytes(out[1])
                new += [flag == ord("1") for flag in flags]
        return new

    def removed(self, remove: Callable[[], Sequence[tuple[str, int]]]) -> None:
        """Run ``remove`` (returns the ``(path, size)`` of each chunk it deleted) and take
        those chunks out of the index."""
        gone = remove()
        if gone:
            names = [self._name_of(path) for path, _ in gone]
            self._call("remove", lambda: self._remove(keys=self._keys, args=names))

    def usage(self) -> Usage:
        """Usage as the index counts it (zero where it holds nothing yet), once the chunks
        published so far are accounted."""
        self.flush()
        ok, raw = self._call("usage", lambda: self.client.hmget(self._keys[0], "bytes", "chunks"))
        if not ok:
            raise ConnectionError(f"{self._label}: capacity index unreachable")
        return Usage(int(raw[0] or 0), int(raw[1] or 0))

    def recount(self) -> Usage:
        """Reconcile the whole store, then report usage."""
        self.reconcile()
        return self.usage()

    def touch(self, paths: Sequence[str], *, recorded: bool = False) -> None:
        """Record uses of these chunks now (LRU order); a chunk the index lacks stays out.
        ``recorded``: the use went to an access record beside each file, which the index
        notes so that the victim's delete removes it (see :meth:`_delete`).

        Sent from the index's own thread, after this store's earlier requests, in one
        pipeline with the others queued: a read does not wait for the round trip."""
        if paths:
            names = [self._name_of(path) for path in paths]
            self._queue("touch", names, time.time())
            if recorded:
                self._queue("record", names)

    def feed(self) -> ChangeFeed:
        """A reader of this store's change feed, from now on: every chunk any writer's index
        step puts in or takes out, in order (see :mod:`chunkstore.backends._feed`)."""
        from chunkstore.backends._feed import ChangeFeed

        return ChangeFeed(self.client, self._keys[4], self._label)

    # --- maintenance ---------------------------------------------------------------

    def evict(self, *, max_bytes: int | None = None, older_than: float | None = None) -> int:
        """Delete least recently used chunks until usage fits ``max_bytes`` (default: the
        store's cap) and none was last used more than ``older_than`` seconds ago.

        Costs what is evicted, not what is stored. Returns how many chunks went.
        """
        self.flush()
        cap = self.max_bytes if max_bytes is None else max_bytes
        before = -1.0 if older_than is None else time.time() - older_than
        total = 0
        kept = self.kept
        while True:
            sent = time.time()
            ok, victims = self._call(
                "evict",
                lambda: self._evict_script(
                    keys=self._keys, args=[-1 if cap is None else cap, MAX_VICTIMS, before]
                ),
            )
            if not ok:
                raise ConnectionError(f"{self._label}: capacity index unreachable")
            total += self._delete(victims, sent)
            if len(victims) - 1 < MAX_VICTIMS:  # (the last element is the records string)
                break
        if self.kept != kept:  # the victims left in place are counted again on return
            self.flush()
        return total

    def reconcile(
        self,
        shard: tuple[int, int] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Reconciled:
        """Make the index agree with the files (of one shard, ``(i, n)``): add what a walk
        finds and the index lacks, note the access records it finds beside chunks (so their
        victims' deletes remove them), take out entries whose files are gone. A reservation
        younger than :data:`RESERVATION_GRACE` stays: its writer may still be writing the
        temp file. The credit of writers not seen for :data:`CREDIT_GRACE` is given back.

        Repairs go :data:`BATCH` to a round trip: one script call adds what a batch of
        the walk found, one takes out the entries of a batch whose files are gone. Safe
        beside live writers: each script is atomic and leaves entries a writer made
        meanwhile alone. Shards of one store may run on several machines at once.
        ``progress(n)`` is told of every 1,000 chunks walked. Raises ConnectionError when
        the index is unreachable (the repairs sent so far stay; ``stale`` stays too). A full
        reconcile clears ``stale``, unless a writer marked it again while the walk ran.
        """
        self.flush()
        # Reservations made since this long ago may still be publishing: not taken out.
        kept = time.time() - RESERVATION_GRACE
        marked = None
        if shard is None:  # a full reconcile clears the stale mark it began with
            marked = self._must("reconcile", lambda: self.client.hget(self._meta, "stale"))
        self._must("reconcile", partial(self._reclaim, self._credit_keys, [CREDIT_GRACE]))
        walked = added = 0
        found = WalkedNames()
        found_four: list[Any] = []  # name, size, last use, has a record: for each chunk

        def add_found() -> None:
            nonlocal added
            call = partial(self._add_found, self._keys, found_four)
            added += int(self._must("reconcile", call))
            found_four.clear()

        for path, size, atime, recorded in self._scan(shard):
            name = self._name_of(path)
            found.add(name)
            found_four += (name, size, atime, int(recorded))
            walked += 1
            if len(found_four) >= 4 * BATCH:
                add_found()
            if progress is not None and walked % 1000 == 0:
                progress(1000)
        if found_four:
            add_found()
        found.freeze()
        removed = 0
        missing: list[str] = []
        checked = 0
        for page in _pages(self._names(shard), BATCH):
            for name, walked_past in zip(page, found.contains_many(page)):
                if walked_past:
                    continue
                # Checked a batch at a time, then taken out at once: a file published
                # between its check and the removal is counted again by the next reconcile.
                if not self._exists(self._path_of(name)):
                    missing.append(name)
                checked += 1
                if checked >= BATCH:
                    removed += self._remove_missing(missing, kept)
                    checked = 0
        removed += self._remove_missing(missing, kept)
        if shard is None:
            seen = "" if marked is None else marked
            self._must("reconcile", partial(self._clear_stale, [self._meta], [seen]))
        self._call("reconcile", lambda: self.client.hset(self._meta, "reconciled", time.time()))
        return Reconciled(walked, added, removed)

    def _must(self, what: str, call: Callable[[], Any]) -> Any:
        """``call``'s result; ConnectionError when the index is down or failed now."""
        ok, result = self._call(what, call)
        if not ok:
            raise ConnectionError(f"{self._label}: capacity index unreachable")
        return result

    def _remove_missing(self, names: list[str], kept: float) -> int:
        """Take ``names`` (entries whose files a reconcile found gone) out in one call, but
        for those reserved at ``kept`` or later (their writers may still publish them)."""
        if not names:
            return 0
        args = [kept, *names]
        taken = int(self._must("reconcile", partial(self._remove_gone, self._keys, args)))
        names.clear()
        return taken

    def stale(self) -> bool:
        """Whether writes went on without the index since the last full reconcile."""
        ok, value = self._call("stale", lambda: self.client.hexists(self._meta, "stale"))
        return bool(value) if ok else True

    def _names(self, shard: tuple[int, int] | None) -> Iterable[str]:
        # Every counted entry, reserved ones included (they are not in the LRU order yet:
        # the removal leaves the young ones alone), a page of the sizes hash a round trip.
        cursor = 0
        while True:
            cursor, page = self._must(
                "reconcile", partial(self.client.hscan, self._keys[2], cursor, count=BATCH)
            )
            for raw in page:
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                if shard is None or shard_of(name, shard[1]) == shard[0]:
                    yield name
            if int(cursor) == 0:
                return

    def _delete(self, victims: Sequence[Any], chosen_at: float) -> int:
        """Delete the files of ``victims`` (what a step sent at ``chosen_at`` returned: the
        names it took out, then a string of ``1`` for each that had an access record the
        index knew of, ``0`` for each that had none), in the store's batches where it has
        them, else one by one (several at a time once they are slow, see
        :meth:`_delete_each`); how many went (a batch counts each delete that did not fail).
        Returns once all are done.

        One at a time, a victim whose file changed after the choice stays, and its account
        is queued again: a put that replaced it, or a read, came after the index chose it.
        Where files show no ctime (``ask_back``: S3, fsspec), a victim the index took in again
        since the choice stays instead: a writer stored it anew and accounted it.
        """
        decoded = [raw.decode() if isinstance(raw, bytes) else str(raw) for raw in victims]
        names = decoded[:-1]
        recorded = [flag == "1" for flag in decoded[-1]] if decoded else []
        if self._ask_back and names:
            names, recorded = self._still_out(names, recorded)
        if self._evict_many is not None and names:
            try:
                deleted = self._evict_many([self._path_of(name) for name in names])
            except OSError as exc:
                # Out of the index but still stored: the next reconcile counts them again.
                log.warning("%s: cannot evict %d chunks: %s", self._label, len(names), exc)
                deleted = 0
            outcomes = []
        else:
            outcomes = self._delete_each(names, recorded, chosen_at)
            deleted = sum(gone for gone, _ in outcomes)
        kept = [
            (name, size, had) for name, had, (_, size) in zip(names, recorded, outcomes) if size
        ]
        with self._lock:
            self.evicted += deleted
            self.kept += len(kept)
        for name, size, had in kept:
            self._queue("account", name, size, 0, b"")
            if had:  # its access record stays with it
                self._queue("record", [name])
        return deleted

    def _delete_each(
        self, names: list[str], recorded: list[bool], chosen_at: float
    ) -> list[tuple[bool, int]]:
        """:meth:`_delete_one` of each of ``names`` (``recorded``: whether each has an access
        record the index knew of), in order: in this thread while each takes less than
        :data:`SLOW_DELETE`, then the rest up to :data:`EVICT_WORKERS` at a time."""
        delete_one = partial(self._delete_one, chosen_at=chosen_at)
        outcomes: list[tuple[bool, int]] = []
        for i, (name, had) in enumerate(zip(names, recorded)):
            start = time.perf_counter()
            outcomes.append(delete_one(name, had))
            if time.perf_counter() - start >= SLOW_DELETE and i + 2 < len(names):
                with self._lock:
                    if self._deleters is None:
                        self._deleters = concurrent.futures.ThreadPoolExecutor(
                            EVICT_WORKERS, thread_name_prefix=f"{self._label}-evict"
                        )
                    deleters = self._deleters
                outcomes += deleters.map(delete_one, names[i + 1 :], recorded[i + 1 :])
                break
        return outcomes

    def _still_out(self, names: list[str], recorded: list[bool]) -> tuple[list[str], list[bool]]:
        """Of victims ``names`` (with their ``recorded`` flags), those not back in the LRU
        order (one round trip). A victim back there was accounted after the index chose it:
        a writer stored it again, so it stays, counted in :attr:`kept`. With the index
        unreachable, all of them."""
        ok, scores = self._call("evict", lambda: self.client.zmscore(self._keys[1], names))
        if not ok:
            return names, recorded
        out = [(name, had) for name, had, score in zip(names, recorded, scores) if score is None]
        with self._lock:
            self.kept += len(names) - len(out)
        return [name for name, _ in out], [had for _, had in out]

    def _delete_one(self, name: str, recorded: bool, chosen_at: float) -> tuple[bool, int]:
        now = time.monotonic()
        with self._lock:
            while self._spared:
                oldest, since = next(iter(self._spared.items()))
                if now - since < SPARE_WINDOW:
                    break
                del self._spared[oldest]
            # Spared once already, or too many spared: delete whatever the ctime says.
            may_spare = name not in self._spared and len(self._spared) < MAX_SPARED
        try:
            chosen = chosen_at if may_spare else math.inf
            deleted, kept = self._evict(self._path_of(name), chosen, recorded)
        except OSError as exc:
            # Out of the index but still on disk: the next reconcile counts it again.
            log.warning("%s: cannot evict %s: %s", self._label, name, exc)
            return False, 0
        if kept:
            with self._lock:
                self._spared[name] = now
        return deleted, kept


class WalkedNames:
    """The names a reconcile's walk found, kept as 8 bytes each: a 64-bit hash per name.

    At 10^7 chunks that is 80 MB where a set of the names would take about 1 GB. Two
    names may share a hash. Then an entry whose file is gone may be taken for walked,
    and stays until the next reconcile; nothing is ever removed by mistake.
    """

    def __init__(self) -> None:
        self._hashes = array.array("q")
        self._sorted: Any = None

    def add(self, name: str) -> None:
        """Count ``name`` as walked; before :meth:`freeze` only."""
        self._hashes.append(hash(name))

    def freeze(self) -> None:
        """Sort what was added, for :meth:`contains_many`."""
        import numpy as np

        self._sorted = np.unique(np.frombuffer(self._hashes, dtype=np.int64))
        self._hashes = array.array("q")

    def contains_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each of ``names`` was walked (or shares a hash with one that was)."""
        import numpy as np

        if not names or self._sorted is None or not len(self._sorted):
            return [False] * len(names)
        wanted = np.fromiter((hash(n) for n in names), dtype=np.int64, count=len(names))
        at = np.searchsorted(self._sorted, wanted).clip(max=len(self._sorted) - 1)
        return [bool(hit) for hit in self._sorted[at] == wanted]


def _weight(request: tuple[Any, ...]) -> int:
    """What ``request`` counts toward a pipeline's :data:`BATCH` and :data:`SEND_MIN`: a
    touch its chunks, any other request one."""
    return len(request[1]) if request[0] == "touch" else 1


def _grouped(requests: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``requests`` with each run of accounts, ``("account", name, size, drawn, link)``, made
    one ``("accounts", [(name, size, drawn, link), ...])`` of at most :data:`ACCOUNT_CHUNKS`: one
    script call for many chunks, in the same order."""
    out: list[tuple[Any, ...]] = []
    for request in requests:
        if request[0] != "account":
            out.append(request)
        elif out and out[-1][0] == "accounts" and len(out[-1][1]) < ACCOUNT_CHUNKS:
            out[-1][1].append(request[1:])
        else:
            out.append(("accounts", [request[1:]]))
    return out


def _as_bytes(raw: Any) -> bytes:
    return raw if isinstance(raw, bytes) else str(raw).encode()


def _pages(items: Iterable[str], size: int) -> Iterable[list[str]]:
    """``items`` in lists of ``size``, the last one shorter."""
    page: list[str] = []
    for item in items:
        page.append(item)
        if len(page) >= size:
            yield page
            page = []
    if page:
        yield page


def store_identity(marker: bytes) -> str:
    """A store's name in the index: BLAKE3 of its layout marker's bytes, 16 hex digits. The
    marker is written once, put-if-absent, so every mount and node reads the same bytes;
    a store whose marker was lost and written anew starts a new index (reconcile fills it)."""
    import blake3

    return blake3.blake3(marker).hexdigest()[:16]


def shard_of(name: str, shards: int) -> int:
    """Which of ``shards`` shards the chunk name ``<ns>/<ab>/<cd>/<hex>.kvc`` falls in: by its
    first fan-out byte, so a shard is whole fan-out directories. Another file's name goes by
    the fan-out directory it sits in, and to shard 0 when it sits in none."""
    parts = name.split("/")
    if len(parts) > 2 and _FANOUT.fullmatch(parts[1]):
        return int(parts[1], 16) % shards
    return 0


def chunks_of_shard(store: Any, shard: tuple[int, int]) -> Iterable[Any]:
    """The :class:`~chunkstore.backends.base.ChunkInfo` of shard ``(i, n)`` of ``store``:
    its own ``list_shard`` where it has one (a filesystem walks only those directories),
    else its listing filtered by the key's first byte."""
    own = getattr(store, "list_shard", None)
    if own is not None:
        return own(shard)  # type: ignore[no-any-return]
    return (i for i in store.list() if int(i.key.hex[:2], 16) % shard[1] == shard[0])


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) as ``(i, n)``; ConfigError otherwise."""
    try:
        index, total = (int(part) for part in text.split("/"))
    except ValueError:
        raise ConfigError(f"shard {text!r} must be i/n, e.g. 0/4") from None
    if not 0 <= index < total or total > 256:
        raise ConfigError(f"shard {text!r}: need 0 <= i < n <= 256")
    return index, total
