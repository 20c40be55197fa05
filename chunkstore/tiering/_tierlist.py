"""The ordered, guarded tiers: one read loop and one write fan-out.

A :class:`TierList` is what a tiered store and an engine's own tier share.

* **Reads.** Each tier in turn gets one batch call. It is asked for the keys
  the earlier tiers did not serve. A store that reads into given memory fills
  the caller's buffers. The caller's ``judge`` decides what a served chunk is
  worth. A chunk it refuses is asked of the next tier.
  :meth:`TierList.start_read` begins the first call. The caller can overlap
  it with other work. :meth:`TierList.finish_read` takes the result and asks
  the later tiers.
* **Presence.** :meth:`TierList.exists_many` asks each tier that is up about
  the keys no earlier tier holds.
* **Writes.** :meth:`TierList.start_writes` starts a batch's write on every
  tier at once. :meth:`TierWrites.settle` takes the results and counts each
  drop.

A call that timed out goes on running. It may still write into its buffers.
So the read loop asks ``fresh`` for new buffers before the next tier reads. A
late write must never land over bytes already judged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from chunkstore.backends.base import Buffer, SupportsGetInto, SupportsGetManyInto
from chunkstore.hashing import ChunkKey
from chunkstore.tiering._guard import GuardedCall, GuardedTier, TierUnavailable

Judge = Callable[[GuardedTier, ChunkKey, Any, bool], Any]
"""``judge(tier, key, data, verified)`` returns what to keep of a served chunk.

``tier`` served ``data`` as ``key``'s chunk. ``verified`` says the tier's read
checked it. ``None`` asks the next tier.
"""

Fresh = Callable[[list[int], Future[Any]], bool]
"""``fresh(positions, running)`` gives the keys at ``positions`` new buffers.

``running`` may still write into the old ones. It returns False if no buffer
is free. The read then stops.
"""

__all__ = ["Judge", "TierList", "TierRead", "TierWrites", "keep_all"]


def keep_all(_tier: GuardedTier, _key: ChunkKey, data: Any, _verified: bool) -> Any:
    """The judge of maintenance reads: every served chunk is kept as it is."""
    return data


def _get_one_into(store: SupportsGetInto, key: ChunkKey, buffer: memoryview) -> list[int | None]:
    """``store.get_into`` of one key, answered as a batch read of one."""
    return [store.get_into(key, buffer)]


class TierRead:
    """One tier's read of some of the keys, under way."""

    __slots__ = ("index", "tier", "asked", "call", "verified", "_views")

    def __init__(
        self,
        index: int,
        tier: GuardedTier,
        asked: list[int],
        call: GuardedCall[Any],
        views: list[memoryview] | None,
        verified: bool,
    ) -> None:
        self.index = index
        """The tier's place in the list; a key it misses is asked of the next."""
        self.tier = tier
        self.asked = asked
        """Positions of the keys asked for, in the caller's list."""
        self.call = call
        self.verified = verified
        """Whether the store checked what it returns: its ``verify`` as the read began."""
        # Read later, a flag turned on meanwhile would vouch for unchecked bytes.
        self._views = views

    @property
    def into_buffers(self) -> bool:
        """Whether the store reads into the caller's buffers, else into its own memory."""
        return self._views is not None

    def result(self) -> list[Any]:
        """Each asked key's bytes, ``None`` where the store has no good copy.

        Raises :class:`TierUnavailable` as a guarded call does.
        """
        got = self.call.result()
        if self._views is None:
            return list(got)
        return [None if n is None else view[:n] for n, view in zip(got, self._views)]


class TierWrites:
    """One batch's writes to every tier, under way; :meth:`settle` takes them."""

    __slots__ = ("calls", "count", "nbytes", "if_absent")

    def __init__(self, count: int, nbytes: int, *, if_absent: bool) -> None:
        self.calls: list[tuple[GuardedTier, GuardedCall[Any] | None, str]] = []
        """Per tier: its call, or ``None`` and why it was refused at once."""
        # Counts and sizes, not the items: a view kept here would keep its buffer mapped.
        self.count = count
        """Items in the batch."""
        self.nbytes = nbytes
        """Bytes handed to each tier."""
        self.if_absent = if_absent
        """Whether each write is a put-if-absent, else a plain put."""

    def futures(self) -> list[Future[Any]]:
        """The calls started; each is done once nothing reads the items' memory."""
        return [call.future for _, call, _ in self.calls if call is not None]

    def settle(
        self,
        on_timeout: Callable[[TierUnavailable], None] | None = None,
    ) -> list[tuple[GuardedTier, list[bool] | None, str]]:
        """Wait for each tier's write.

        Per tier, returns what it answered, or ``None`` and why it failed.
        ``tier_down`` means its writes are stopped. ``tier_error`` means it
        failed, timed out or is in back-off. A failed tier counts the items as
        dropped. ``on_timeout`` hears of each call that timed out and still
        runs. Such a call may still read the items' memory.
        """
        out: list[tuple[GuardedTier, list[bool] | None, str]] = []
        for tier, call, refused in self.calls:
            if call is None:
                tier.count_drop(refused, self.count)
                out.append((tier, None, refused))
                continue
            try:
                written = list(call.result())
            except TierUnavailable as exc:
                if on_timeout is not None and exc.pending is not None:
                    on_timeout(exc)
                tier.count_drop("tier_error", self.count)
                out.append((tier, None, "tier_error"))
                continue
            tier.instruments.record_write(self.nbytes, call.seconds())
            tier.count_writes(sum(1 for ok in written if ok))
            out.append((tier, written, ""))
        return out


class TierList:
    """Guarded tiers in the order they are read; see the module docstring."""

    def __init__(self, tiers: Sequence[GuardedTier]) -> None:
        self.tiers = tuple(tiers)

    def __iter__(self) -> Iterator[GuardedTier]:
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def __getitem__(self, index: int) -> GuardedTier:
        return self.tiers[index]

    # --- reads ----------------------------------------------------------------------------

    def start_read(
        self,
        keys: Sequence[ChunkKey],
        buffers: list[Any] | None,
        missing: list[int],
        first: int = 0,
        *,
        unchecked: bool = False,
    ) -> TierRead | None:
        """Start reading the keys at ``missing`` from the first tier that takes calls.

        The search starts at tier ``first``. Returns ``None`` when no tier takes
        calls. ``buffers`` holds one buffer per key. A store that reads into
        given memory fills them. Without ``buffers``, every store returns bytes
        of its own. ``unchecked`` makes it the maintenance read. That read
        checks nothing and counts no use.
        """
        # A store with get_into but no batch form still reads into the buffer for one key.
        asked = [keys[i] for i in missing]
        for index in range(first, len(self.tiers)):
            tier = self.tiers[index]
            store = tier.store
            verified = store.verify
            try:
                if unchecked:
                    raw = tier.start("get", store.read_unchecked_many, asked)
                    return TierRead(index, tier, missing, raw, None, False)
                if buffers is not None and isinstance(store, SupportsGetManyInto):
                    views = [memoryview(buffers[i]) for i in missing]
                    call = tier.start("get", store.get_many_into, asked, views)
                    return TierRead(index, tier, missing, call, views, verified)
                if buffers is not None and len(asked) == 1 and isinstance(store, SupportsGetInto):
                    views = [memoryview(buffers[missing[0]])]
                    call = tier.start("get", _get_one_into, store, asked[0], views[0])
                    return TierRead(index, tier, missing, call, views, verified)
                whole = tier.start("get", store.get_many, asked)
                return TierRead(index, tier, missing, whole, None, verified)
            except TierUnavailable:
                continue  # in back-off: refused at once
        return None

    def finish_read(
        self,
        keys: Sequence[ChunkKey],
        buffers: list[Any] | None,
        read: TierRead | None,
        *,
        judge: Judge,
        pending: list[Future[Any]] | None = None,
        fresh: Fresh | None = None,
        count: bool = False,
        unchecked: bool = False,
    ) -> list[Any | None]:
        """What ``judge`` kept of each key's chunk, from the first tier that served one.

        An entry is ``None`` where no tier served a chunk it kept. ``read`` is the
        first tier's call, already started. ``count`` counts each tier's hits and
        misses. A store's reads set it. An engine's tier counts at lookup
        instead. Calls that timed out but still run are added to ``pending``.
        With ``buffers``, ``fresh`` first gives their keys new buffers.
        """
        kept: list[Any | None] = [None] * len(keys)
        while read is not None:
            tier = read.tier
            try:
                got = read.result()
            except TierUnavailable as exc:
                got = [None] * len(read.asked)
                if exc.pending is not None and read.into_buffers:
                    if fresh is None or not fresh(read.asked, exc.pending):
                        if pending is not None:
                            pending.append(exc.pending)
                        if count:
                            tier.count_reads(0, len(read.asked))
                        break  # the buffers are not safe to read into again
            nbytes = 0
            for i, data in zip(read.asked, got):
                if data is None:
                    continue  # missing, or corrupt (the store checked it and set it aside)
                kept[i] = judge(tier, keys[i], data, read.verified)
                nbytes += len(data) if kept[i] is not None else 0
            if nbytes:
                tier.instruments.record_read(nbytes, read.call.seconds())
            missing = [i for i, k in enumerate(kept) if k is None]
            if count:
                tier.count_reads(len(read.asked) - len(missing), len(missing))
            read = self._start_next(keys, buffers, missing, read.index + 1, count, unchecked)
        return kept

    def _start_next(
        self,
        keys: Sequence[ChunkKey],
        buffers: list[Any] | None,
        missing: list[int],
        first: int,
        count: bool,
        unchecked: bool = False,
    ) -> TierRead | None:
        """Run :meth:`start_read`, counting a miss for each key in each refusing tier."""
        if not missing:
            return None
        read = self.start_read(keys, buffers, missing, first, unchecked=unchecked)
        if count:
            end = len(self.tiers) if read is None else read.index
            for refused in self.tiers[first:end]:
                refused.count_reads(0, len(missing))
        return read

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        *,
        judge: Judge,
        buffers: list[Any] | None = None,
        count: bool = False,
        unchecked: bool = False,
    ) -> list[Any | None]:
        """Start a read now and :meth:`finish_read` it.

        The stores read into their own memory, or into ``buffers``. Give
        ``buffers`` only where no call can outlive the read. That holds for
        tiers with no timeout. It also holds for memory that stays the read's
        until every call has ended.
        """
        missing = list(range(len(keys)))
        read = self._start_next(keys, buffers, missing, 0, count, unchecked)
        return self.finish_read(keys, buffers, read, judge=judge, count=count, unchecked=unchecked)

    # --- presence -------------------------------------------------------------------------

    def exists_many(self, keys: Sequence[ChunkKey], *, count: bool = False) -> list[bool]:
        """Whether some tier that is up holds each key; a tier that fails answers no.

        With ``count``, each tier counts its hits and misses. An engine's
        lookups use it.
        """
        present = [False] * len(keys)
        missing = list(range(len(keys)))
        for tier in self.tiers:
            if not missing:
                break
            if not tier.up:
                continue
            started = time.perf_counter()
            try:
                found = tier.call("exists", tier.store.exists_many, [keys[i] for i in missing])
            except TierUnavailable:
                continue
            tier.instruments.lookup_latency.observe(time.perf_counter() - started)
            for i, hit in zip(missing, found):
                present[i] = bool(hit)
            before = len(missing)
            missing = [i for i in missing if not present[i]]
            if count:
                tier.instruments.hits.inc(before - len(missing))
                tier.instruments.misses.inc(len(missing))
        return present

    # --- writes ---------------------------------------------------------------------------

    def start_writes(
        self,
        writes: TierWrites,
        items: list[tuple[ChunkKey, Buffer]],
        tiers: Sequence[GuardedTier] | None = None,
    ) -> TierWrites:
        """Start writing ``items`` on every tier at once, recording the calls in ``writes``.

        ``tiers`` limits the write to some tiers. A tier is refused at once if
        its writes are stopped or in back-off. A full or read-only tier has its
        writes stopped. :meth:`TierWrites.settle` counts a refusal. Each call
        enters ``writes`` as soon as it starts. So a caller that meets an error
        part-way still knows what runs.
        """
        for tier in self.tiers if tiers is None else tiers:
            if not tier.writable:  # a full or read-only tier still serves reads
                writes.calls.append((tier, None, "tier_down"))
                continue
            store = tier.store
            method = store.put_if_absent_many if writes.if_absent else store.put_many
            try:
                writes.calls.append((tier, tier.start("put", method, items), ""))
            except TierUnavailable:
                writes.calls.append((tier, None, "tier_error"))
        return writes
