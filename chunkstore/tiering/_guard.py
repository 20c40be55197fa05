"""Calls into a secondary tier with a timeout and a back-off after failures.

A tier that raises, or does not answer within ``timeout``, is marked down.
It stays down for ``retry_after`` seconds. Calls during that time fail fast.
The tiered store treats them as misses or dropped writes. The first call after
that time tries the tier again. The serving path never sees the tier's
exception.

Reads and writes have separate health. Some writes fail because the tier is
full, read-only or not writable for us. The errors are ENOSPC, EDQUOT, EFBIG,
EROFS, EACCES and EPERM. Such a failure stops only the writes. What the tier
holds stays readable. Any other failure stops both. Examples are an
unreachable tier, a hang or a failed read. A bad entry or a bad argument says
nothing about the tier's health. It marks nothing down. Examples are a key that
does not parse, or a damaged chunk.

A call that times out cannot be stopped. It goes on running on its worker
thread. It may still read or write the memory it was given. So the
:class:`TierUnavailable` it raises carries the running call as ``pending``.
The caller gives that memory back only from
:meth:`TierUnavailable.when_settled`. A host slot stays pinned until then.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

from chunkstore._threads import started_executor
from chunkstore.backends.base import Store, set_asides_handed_to
from chunkstore.errors import ConfigError, FormatError, KeyParseError
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import TierInstruments

log = logging.getLogger(__name__)

R = TypeVar("R")

WRITE_OPS = frozenset({"put", "delete"})
"""Operations that change the tier; every other op name is a read."""
WRITE_FAULT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
)
"""Errors that say the tier cannot take writes, not that it cannot be read."""
_NOT_THE_TIER = (KeyParseError, FormatError, ConfigError)
"""Errors about one entry or about the request: the tier itself answered."""


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during.

    Stores re-wrap OSErrors, so the chain matters.
    """
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def is_write_fault(exc: BaseException) -> bool:
    """Whether ``exc`` or what it wraps says the tier is full, read-only or denied."""
    return any(
        isinstance(e, PermissionError) or (isinstance(e, OSError) and e.errno in WRITE_FAULT_ERRNOS)
        for e in _causes(exc)
    )


class TierUnavailable(Exception):
    """The tier is in back-off, failed or timed out.

    The error is internal. It never leaves the cache package.
    """

    def __init__(self, name: str, pending: Future[Any] | None = None) -> None:
        super().__init__(name)
        self.pending = pending
        """The timed-out call, which still runs and still uses the buffers passed to it."""

    def when_settled(self, release: Callable[[], None]) -> None:
        """Run ``release`` once nothing uses the memory handed to the failed call.

        If the call has ended or never started, ``release`` runs at once.
        Otherwise it runs on the worker thread when the abandoned call ends.
        """
        if self.pending is None:
            release()
        else:
            self.pending.add_done_callback(lambda _done: release())


class GuardedCall(Generic[R]):
    """A call that :meth:`GuardedTier.start` began; :meth:`result` waits for it once."""

    def __init__(
        self,
        tier: GuardedTier,
        op: str,
        future: Future[R],
        deadline: float | None,
        began: float,
    ) -> None:
        self._tier = tier
        self._op = op
        self.future = future
        """The call's future, done once nothing uses the memory handed to it."""
        self._deadline = deadline
        self._began = began
        self._ended = 0.0
        future.add_done_callback(self._end)

    def _end(self, _future: Future[R]) -> None:
        self._ended = time.perf_counter()

    def result(self) -> R:
        """What the call returned, waiting at most until its deadline.

        Raises :class:`TierUnavailable` as :meth:`GuardedTier.call` does.
        """
        return self._tier._settle(self._op, self.future, self._deadline)

    def seconds(self) -> float:
        """Seconds from the start of the call to its end.

        The time stops at the call's end, not when the caller took the result.
        The store's latency metrics record this time.
        """
        # A waiter may wake before the done callback ran: then the end is now.
        end = self._ended if self._ended >= self._began else time.perf_counter()
        return end - self._began


class GuardedTier:
    """One secondary store with its health, counters and metric instruments.

    The counters are ``hits``, ``misses``, ``promotions``, ``writes``,
    ``errors`` and ``dropped``. Only the ``count_*`` methods and the guarded
    calls change them. They do so under the tier's own lock.
    """

    def __init__(
        self,
        store: Store,
        instruments: TierInstruments,
        *,
        timeout: float | None,
        retry_after: float,
        clock: Callable[[], float] = time.monotonic,
        workers: int = 4,
        start_workers: bool = False,
    ) -> None:
        self.store = store
        self.name = store.name
        self.instruments = instruments
        self.timeout = timeout
        self.retry_after = retry_after
        self._clock = clock
        self._read_down_until: float | None = None
        self._write_down_until: float | None = None
        self._lock = threading.Lock()
        # A call that times out keeps running on its worker; Python threads cannot be
        # stopped. Once the tier is retried, the pool lets later calls pass a few stuck ones.
        # TierUnavailable.pending tells the caller its buffers are still in use.
        # start_workers starts them all now, for a tier that takes bursts of writes at once.
        prefix = f"chunkstore-tier-{self.name}"
        self._executor = (
            None
            if timeout is None
            else started_executor(workers, prefix)
            if start_workers
            else ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
        )
        self.hits = 0
        self.misses = 0
        self.promotions = 0
        self.writes = 0
        self.errors = 0
        self.abandoned = 0
        """Timed-out calls still running; each may hold host memory until it ends."""
        self.dropped: dict[str, int] = {}

    @property
    def up(self) -> bool:
        """False while reads of the tier are in back-off after a failure or a timeout."""
        return self._is_up(self._read_down_until)

    @property
    def writable(self) -> bool:
        """False while writes to the tier are in back-off, as when it is full or read-only."""
        return self._is_up(self._write_down_until)

    def _is_up(self, until: float | None) -> bool:
        return until is None or self._clock() >= until

    def call(self, op: str, fn: Callable[..., R], *args: Any) -> R:
        """Run ``fn(*args)`` under the timeout.

        Any failure raises :class:`TierUnavailable`. ``op`` names the operation.
        ``put`` and ``delete`` are writes, checked against :attr:`writable`.
        Every other operation is a read, checked against :attr:`up`.
        """
        return self.start(op, fn, *args).result()

    def start(self, op: str, fn: Callable[..., R], *args: Any) -> GuardedCall[R]:
        """Begin :meth:`call` without waiting for it.

        The caller does other work while the call runs, such as converting the
        next chunk. It then takes :meth:`GuardedCall.result`. The timeout counts
        from now. While the tier is in back-off for ``op``, this raises
        :class:`TierUnavailable` at once. Without a timeout, the call runs here,
        before this returns.
        """
        write = op in WRITE_OPS
        if not (self.writable if write else self.up):
            raise TierUnavailable(self.name)
        began = time.perf_counter()
        future: Future[R]
        if self._executor is None:
            future = Future()
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - judged by GuardedCall.result
                future.set_exception(exc)
            return GuardedCall(self, op, future, None, began)
        future = self._executor.submit(fn, *args)
        assert self.timeout is not None
        return GuardedCall(self, op, future, time.monotonic() + self.timeout, began)

    def hand_off(self, op: str, fn: Callable[..., Any], *args: Any) -> str | None:
        """Begin ``fn(*args)`` as :meth:`start` does, and let nobody wait for it.

        This is for work whose outcome the caller does not need. An example is
        setting aside a damaged copy that a read found. A tier that stalls in it
        holds one of its own workers, not the caller.

        When the call ends, :meth:`call`'s rules judge what it raised. A failure
        is logged and counted, and the tier is backed off. The call has no
        deadline to miss. The next waited-for call finds a stalling tier.
        Without a timeout, the call runs here, before this returns. Returns
        ``None`` once the call is made. Otherwise it returns why not: the tier
        is in back-off for ``op``, or closed. ``fn`` is then not called.
        """
        try:
            call = self.start(op, fn, *args)
        except TierUnavailable:
            return f"tier {self.name} is in back-off"
        except RuntimeError:  # its workers were shut down: the tier is closed
            return f"tier {self.name} is closed"

        def settle(future: Future[Any]) -> None:
            if future.cancelled():  # still queued when the tier closed: it never ran
                log.info("tier %s: %s dropped at close", self.name, op)
                return
            try:
                call.result()  # done: returns or judges its failure at once
            except TierUnavailable:
                pass  # judged and logged by result(); nobody to tell

        call.future.add_done_callback(settle)
        return None

    def handing_off_set_asides(self) -> AbstractContextManager[None]:
        """Within the block, hand this thread's corrupt-chunk reports to this tier's guard.

        The guard sets the chunk aside, not this thread. It runs the set-aside
        through :meth:`hand_off` as a ``delete``. A caller uses this when it
        judged this tier's chunk itself, as :func:`set_asides_handed_to` does.
        """
        return set_asides_handed_to(lambda set_aside: self.hand_off("delete", set_aside))

    def _settle(self, op: str, future: Future[R], deadline: float | None) -> R:
        """The result of a started call, judged as :meth:`call` describes."""
        write = op in WRITE_OPS
        try:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            result = future.result(wait_s)
        except FutureTimeout:
            # A call still queued behind stuck ones is cancelled. One already running cannot
            # be stopped, so the caller keeps its buffers alive until it ends.
            pending = None if future.cancel() else self._abandon(future)
            self._failed(op, f"timed out after {self.timeout} s", writes_only=False)
            raise TierUnavailable(self.name, pending) from None
        except _NOT_THE_TIER as exc:
            # One unparsable entry or a bad argument: a miss for this call, the tier stays up.
            self.instruments.error(op)
            log.warning("tier %s: %s: %s: %s", self.name, op, type(exc).__name__, exc)
            raise TierUnavailable(self.name) from exc
        except Exception as exc:  # noqa: BLE001 - any tier failure degrades to a miss
            self._failed(
                op, f"{type(exc).__name__}: {exc}", writes_only=write and is_write_fault(exc)
            )
            raise TierUnavailable(self.name) from exc
        if (self._write_down_until if write else self._read_down_until) is not None:
            self._answered(write)
        return result

    def _answered(self, write: bool) -> None:
        with self._lock:
            if write and self._write_down_until is not None:
                log.info("tier %s takes writes again", self.name)
                self._write_down_until = None
            elif not write and self._read_down_until is not None:
                log.info("tier %s answers again", self.name)
                self._read_down_until = None

    def _abandon(self, future: Future[R]) -> Future[R]:
        with self._lock:
            self.abandoned += 1
        future.add_done_callback(self._settled)
        return future

    def _settled(self, _future: Future[Any]) -> None:
        with self._lock:
            self.abandoned -= 1

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the tier holds; 0 when it fails or times out."""
        started = time.perf_counter()
        try:
            found: int = self.call("lookup", self.store.lookup_prefix, keys)
        except TierUnavailable:
            return 0
        self.instruments.lookup_latency.observe(time.perf_counter() - started)
        return found

    def count_reads(self, hits: int, misses: int) -> None:
        """Count ``hits`` chunks this tier served and ``misses`` it lacked or could not serve."""
        with self._lock:
            self.hits += hits
            self.misses += misses
        if hits:
            self.instruments.hits.inc(hits)
        if misses:
            self.instruments.misses.inc(misses)

    def count_promotions(self, count: int = 1) -> None:
        """Count ``count`` chunks copied from this tier into host memory."""
        with self._lock:
            self.promotions += count
        self.instruments.promotions.inc(count)

    def count_writes(self, count: int) -> None:
        """Count ``count`` chunks written into this tier."""
        with self._lock:
            self.writes += count

    def count_drop(self, reason: str, count: int = 1) -> None:
        """Count ``count`` writes to this tier that were not performed."""
        with self._lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + count
        self.instruments.dropped(reason, count)

    def _failed(self, op: str, why: str, *, writes_only: bool) -> None:
        """Back off from writes only for a full or read-only tier; else from both."""
        with self._lock:
            self.errors += 1
            now = self._clock()
            first = self._is_up(self._write_down_until) and (
                writes_only or self._is_up(self._read_down_until)
            )
            self._write_down_until = now + self.retry_after
            if not writes_only:
                self._read_down_until = now + self.retry_after
        self.instruments.error(op)
        if first:
            log.warning(
                "tier %s: %s %s; %s for %.1f s",
                self.name,
                op,
                why,
                "not writing to it (reads go on)" if writes_only else "treating it as a miss",
                self.retry_after,
            )

    def close(self) -> None:
        """Stop the worker threads. Calls still running are abandoned, not awaited."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
