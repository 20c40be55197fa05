"""HostCache: tier 0, a byte-bounded cache of whole chunks in a slot pool.

A :class:`HostCache` is a :class:`~chunkstore.backends.base.Store`, so the conformance
suite applies.
Its capacity is ``num_slots`` chunks of at most ``slot_size`` bytes.
A :class:`~chunkstore.cache.policy.CachePolicy` decides which chunks stay, ``parc`` by default.
The :class:`~chunkstore.cache._pool.SlotPool` decides which bytes live where.

Besides the store methods it offers the host-slot fast paths.
Device copies and peer transfers need them.

* :meth:`HostCache.reserve`, :meth:`HostCache.commit` and :meth:`HostCache.abort` write a
  chunk in place. TP shards go straight into the slot, which is then sealed.
* :meth:`HostCache.acquire` and :meth:`HostCache.release` read a chunk in place.
* :meth:`HostCache.get_into` copies a hit into a caller buffer.

A slot that is reserved or acquired is **pinned**: the policy never evicts it.
Every pin belongs to a :class:`~chunkstore.cache._lease.Lease`.
That is the one slot handle, also what TP ranks get.
Leases are context managers, so pins are released on every exit path.
Releasing twice is harmless.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from chunkstore.backends.base import Buffer, ChunkInfo, Judgement, Store
from chunkstore.cache._chains import chunk_parent
from chunkstore.cache._lease import Lease
from chunkstore.cache._lending import SlotLoans
from chunkstore.cache._pool import DOOMED, READY, SlotPool, StaleSlot
from chunkstore.cache.policy import DEFAULT_POLICY, CachePolicy, NoEvictableEntry, make_policy
from chunkstore.errors import ConfigError
from chunkstore.events import ChunkListener
from chunkstore.format import MAX_HEADER_BYTES, ChunkLayout, header_bytes_needed
from chunkstore.hashing import ChunkKey, check_namespace

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Insertion:
    """What :meth:`HostCache.insert` did."""

    written: bool
    """The chunk is now cached by this call."""
    present: bool
    """Not written because the key was already cached (only with ``if_absent``)."""
    lease: Lease | None
    """The still-pinned slot, when ``keep_pinned`` was asked and the chunk was written."""


@dataclass(frozen=True, slots=True)
class Adoption:
    """What :meth:`~chunkstore.cache._lending.SlotLoans.adopt` did with a sealed, lent slot."""

    key: ChunkKey
    """The chunk's key."""
    published: bool
    """The chunk is now cached from that slot (False: the key was already cached)."""
    lease: Lease | None
    """A read lease on it, when ``keep_pinned`` was asked and it was published."""


@dataclass(frozen=True, slots=True)
class HostCacheStats:
    """Counters of one host cache since it was created."""

    hits: int
    """Reads (get, get_into, acquire) served from host memory."""
    misses: int
    """Reads of keys not in host memory."""
    evictions: int
    """Chunks the policy pushed out to make room."""
    rejected: int
    """Writes refused because every slot was pinned (or the chunk exceeds a slot)."""
    chunks: int
    """Chunks resident now."""
    bytes_used: int
    """Bytes of chunk data resident now."""
    capacity_bytes: int
    """``num_slots * slot_size``."""
    pinned_slots: int
    """Slots currently pinned by any process."""
    lent_slots: int = 0
    """Slots lent to TP rank processes for shard assembly (free, claimed or sealed)."""


class HostCache(Store):
    """Whole chunks in a preallocated slot pool, evicted by a policy, ``parc`` by default.

    Thread-safe.
    ``slot_size`` is bytes per slot, or a :class:`ChunkLayout` whose ``total_size`` is used.
    Capacity is ``num_slots``, or ``capacity_bytes // slot_size``.
    ``shm_name`` places the pool in ``/dev/shm/<shm_name>``.
    Other processes can then :meth:`SlotPool.attach` it.
    This process owns it and removes it on :meth:`close`.
    Host memory is trusted, so ``verify`` defaults to False.
    Chunks are checked when they enter from a secondary tier.

    One class because every path takes one lock over the pool, the index and the policy.
    The pool, the leases and the TP slot loans live in modules of their own.
    """

    kind = "host"

    # ``verify``: check every chunk on read (get, get_many, get_into). Off by default:
    # host memory is trusted, and chunks are checked when they come from a lower tier.

    def __init__(
        self,
        slot_size: int | ChunkLayout,
        *,
        num_slots: int | None = None,
        capacity_bytes: int | None = None,
        policy: str | CachePolicy = DEFAULT_POLICY,
        shm_name: str | None = None,
        shm_replace: bool = False,
        pin_memory: bool | None = None,
        name: str | None = None,
        verify: bool = False,
    ) -> None:
        super().__init__(name=name, verify=verify)
        size = slot_size.total_size if isinstance(slot_size, ChunkLayout) else int(slot_size)
        if size < 1:
            raise ConfigError(f"slot size must be positive, got {size}")
        if (num_slots is None) == (capacity_bytes is None):
            raise ConfigError("give the host cache exactly one of num_slots or capacity_bytes")
        if num_slots is None:
            assert capacity_bytes is not None
            num_slots = capacity_bytes // size
            if num_slots < 1:
                raise ConfigError(
                    f"host cache capacity {capacity_bytes} B is smaller than one chunk ({size} B)"
                )
        if isinstance(policy, CachePolicy):
            if policy.capacity != num_slots:
                raise ConfigError(f"policy capacity {policy.capacity} != {num_slots} slots")
            self._policy = policy
        else:
            self._policy = make_policy(policy, num_slots)
        self.policy_name = self._policy.name
        """``"parc"``, ``"arc"`` or ``"lru"``."""
        self.pool = SlotPool.create(
            size, num_slots, name=shm_name, pin_memory=pin_memory, replace=shm_replace
        )
        """The slot pool (shared when ``shm_name`` was given)."""
        self.slot_size = size
        """Bytes per slot: the largest chunk this cache holds."""
        self.num_slots = num_slots
        """Number of slots."""
        # One lock for our dicts and the shared slot table: the pool's (a thread lock plus,
        # for shared pools, flock), so pins taken by other processes never race ours.
        self._lock = self.pool
        self._index: dict[ChunkKey, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._doomed: set[int] = set()
        self._mtime = [0.0] * num_slots
        self._atime = [0.0] * num_slots
        self._bytes_used = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._rejected = 0
        self._closed = False
        self.loans = SlotLoans(self)
        """Slots on loan to TP rank processes, see :mod:`chunkstore.cache.assembly`.
        They are out of the free list and of the index until adopted or recalled.
        A slot is adopted with the chunk sealed in it."""
        self.listener: ChunkListener | None = None
        """Told of every chunk published here, and every one evicted or deleted.
        The caller holds this cache's lock meanwhile. None means nobody listens."""

    # --- capabilities / stats -------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        """``num_slots * slot_size``."""
        return self.num_slots * self.slot_size

    def stats(self) -> HostCacheStats:
        """A snapshot of the counters."""
        with self._lock:
            return HostCacheStats(
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                rejected=self._rejected,
                chunks=len(self._ready_keys()),
                bytes_used=self._bytes_used,
                capacity_bytes=self.capacity_bytes,
                pinned_slots=self.pool.pinned_slots() if not self.pool.closed else 0,
                lent_slots=len(self.loans),
            )

    def memory_regions(self) -> list[memoryview]:
        """Buffers that contain every view :meth:`acquire` and :meth:`reserve` return.

        They never move while the cache is open.
        A transfer engine such as NIXL registers them once.
        It then reads or writes any slot in place.
        """
        self._check_open()
        return [self.pool.data_region()]

    def _ready_keys(self) -> list[ChunkKey]:
        state = self.pool.state
        return [k for k, s in self._index.items() if state(s) == READY]

    # --- fast paths: reserve / commit / abort -------------------------------------------------

    def reserve(self, key: ChunkKey, *, evict: bool = True) -> Lease | None:
        """A pinned, writable slot for ``key``, or ``None`` when every slot is pinned.

        Write the chunk into ``lease.view``, which has ``slot_size`` bytes.
        For example, write one :meth:`ChunkLayout.write_shard` per TP rank, then ``seal_chunk``.
        Then call :meth:`commit`. Until then readers miss the key.
        Reserving a key that is already cached replaces it on commit.
        Its old slot serves current readers.

        ``evict=False`` is for speculative reads, promoting a chunk a lower tier may not have.
        It only takes a free slot.
        It returns ``None`` when there is none, not counted as rejected.
        It leaves the policy alone until :meth:`commit`.
        So an :meth:`abort` after a miss has evicted nothing and recorded no use of ``key``.
        """
        with self._lock:
            self._check_open()
            if evict:
                slot = self._allocate(key)
                if slot is None:
                    self._rejected += 1
                    return None
            else:
                self._reclaim_doomed()
                if not self._free:
                    return None
                slot = self._free.pop()
            generation = self.pool.assign(slot, key)
            # A new key is indexed at once (as WRITING: readers miss it) so that the policy's
            # resident set and the index agree (without eviction the policy learns of it at
            # commit); a cached key keeps serving its old slot.
            self._index.setdefault(key, slot)
            self._mtime[slot] = self._atime[slot] = time.time()
        return Lease(self, key, slot, generation, self.pool.view(slot), writing=True)

    def commit(self, lease: Lease, length: int | None = None, *, keep_pinned: bool = False) -> None:
        """Publish a reserved slot holding ``length`` bytes, by default the whole slot.

        ``keep_pinned`` turns the write lease into a read lease that the caller releases later.
        The tiered store holds it until write-back is done.
        """
        if lease.released or not lease.writing:
            raise StaleSlot(f"{lease!r} is not an open reservation")
        size = self.slot_size if length is None else int(length)
        if not 0 <= size <= self.slot_size:
            raise ConfigError(f"chunk length {size} is outside 0..{self.slot_size}")
        with self._lock:
            self._check_open()
            pool = self.pool
            slot = lease.slot
            if pool.generation(slot) != lease.generation:
                raise StaleSlot(f"{lease!r} was reassigned before commit")
            if pool.state(slot) == DOOMED:
                self._yield_to_winner(lease, keep_pinned)
                return
            pool.publish(slot, size)
            self._bytes_used += size
            self._mtime[slot] = self._atime[slot] = time.time()
            old = self._index.get(lease.key)
            if old is not None and old != slot and pool.state(old) == READY:
                # The replaced copy keeps serving its readers until they let go. Another
                # reservation of the key still WRITING is left alone: its own commit or
                # abort finishes it (dooming it here would free it under its writer).
                self._retire(old)
            self._index[lease.key] = slot
            if lease.key not in self._policy:
                # The old slot was deleted meanwhile: re-admit (the reservation's room is gone).
                self._readmit(lease.key)
            self._link_parent(lease.key, slot)
            if self.listener is not None:
                self.listener.chunk_stored(lease.key, self.name)
            lease.writing = False
            lease.view = lease.view[:size]
            if not keep_pinned:
                lease.released = True
                self._unpin(slot)

    def _yield_to_winner(self, lease: Lease, keep_pinned: bool) -> None:
        """Finish a reservation whose slot was doomed before it committed.

        The caller holds the lock.
        Chunks are content-addressed, so the cached copy is as good as ours.
        With ``keep_pinned`` the lease becomes a read lease on that copy.
        A caller that asked for a pinned chunk never gets a released lease.
        Its slot could be reused under it.
        """
        pool = self.pool
        winner = self._index.get(lease.key)
        if keep_pinned and winner is not None and pool.state(winner) == READY:
            self._atime[winner] = time.time()
            self._unpin(lease.slot)
            lease.slot = winner
            lease.generation, lease.view = self._pin_for_reading(winner)
            lease.writing = False
            return
        lease.released = True
        self._unpin(lease.slot)
        if keep_pinned:
            raise StaleSlot(f"{lease!r} was replaced before commit and no copy is cached")

    def abort(self, lease: Lease) -> None:
        """Give up a reservation, or release a read lease. Idempotent."""
        if lease.released:
            return
        if not lease.writing:
            self.release(lease)
            return
        with self._lock:
            lease.released = True
            slot = lease.slot
            pool = self.pool
            if pool.closed or pool.generation(slot) != lease.generation:
                return
            pool.unpin(slot)
            if self._index.get(lease.key) == slot:
                # The reservation never published: the key was not cached before it. (A
                # reservation without eviction never entered the policy: leave its history.)
                del self._index[lease.key]
                if lease.key in self._policy:
                    self._policy.remove(lease.key)
            self._retire(slot)

    # --- fast paths: acquire / release / get_into ---------------------------------------------

    def acquire(self, key: ChunkKey) -> Lease | None:
        """Pin ``key``'s slot for reading in place. ``None`` on a miss. Counts a hit or miss."""
        with self._lock:
            self._check_open()
            slot = self._index.get(key)
            if slot is None or self.pool.state(slot) != READY:
                self._misses += 1
                return None
            self._policy.hit(key)
            self._hits += 1
            self._atime[slot] = time.time()
            generation, view = self._pin_for_reading(slot)
        return Lease(self, key, slot, generation, view, writing=False)

    def release(self, lease: Lease) -> None:
        """Drop a read pin. Idempotent: it never raises for an already-released lease."""
        if lease.released:
            return
        if lease.writing:
            self.abort(lease)
            return
        with self._lock:
            lease.released = True
            if not self.pool.closed:
                self._unpin(lease.slot)

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Copy a cached chunk into ``buffer``. Returns its size, or ``None`` on a miss.

        With ``verify`` the chunk is checked first.
        A corrupt one is counted, dropped from the cache and reported as a miss.
        """
        lease = self.acquire(key)
        if lease is None:
            return None
        try:
            if self.verify and self._checked(key, lease.view) is None:
                return None
            return _copy_into(buffer, lease.view)
        finally:
            self.release(lease)

    def _admit(self, key: ChunkKey, judgement: Judgement) -> bool:
        # Verified reads (get, get_many, get_into) pin through acquire, which counted a hit;
        # bytes that may not be served make that read a miss after all.
        admitted = super()._admit(key, judgement)
        if not admitted:
            with self._lock:
                self._hits -= 1
                self._misses += 1
        return admitted

    # --- Store primitives -----------------------------------------------------------------------

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            lease = self.acquire(key)
            if lease is None:
                out.append(None)
                continue
            try:
                out.append(bytes(lease.view))
            finally:
                self.release(lease)
        return out

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Cached bytes per key. This is not a use.
        No hit is counted, and neither the policy nor access times are updated."""
        return [self._copy_unchecked(key, headers_only=False) for key in keys]

    def read_headers_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Each cached chunk's header bytes, its length prefix included, and no payload.
        None for a key not cached. Not a use, as :meth:`read_unchecked_many`.

        The length prefix says how many bytes to copy.
        Bytes that are not a chunk come back as they are, up to that many.
        :func:`~chunkstore.format.read_header` then refuses them.
        """
        return [self._copy_unchecked(key, headers_only=True) for key in keys]

    def _copy_unchecked(self, key: ChunkKey, *, headers_only: bool) -> bytes | None:
        """A copy of ``key``'s cached bytes, or of its header only, taken under a pin."""
        with self._lock:
            self._check_open()
            slot = self._index.get(key)
            if slot is None or self.pool.state(slot) != READY:
                return None
            self.pool.pin(slot)
            length = self.pool.length(slot)
        try:
            view = self.pool.view(slot)[:length]
            if headers_only and length >= 8:
                length = min(length, header_bytes_needed(view), 8 + MAX_HEADER_BYTES)
            return bytes(view[:length])
        finally:
            with self._lock:
                if not self.pool.closed:
                    self._unpin(slot)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [self._is_ready(k) for k in keys]

    def _is_ready(self, key: ChunkKey) -> bool:
        slot = self._index.get(key)
        return slot is not None and self.pool.state(slot) == READY

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return [self.insert(key, data).written for key, data in items]

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return [self.insert(key, data, if_absent=True).written for key, data in items]

    def insert(
        self, key: ChunkKey, data: Buffer, *, if_absent: bool = False, keep_pinned: bool = False
    ) -> Insertion:
        """Copy ``data`` into a slot for ``key``. See :class:`Insertion` for the outcome.

        ``if_absent`` writes only when the key is not cached, atomically.
        The copy then happens under the cache lock.
        So of two concurrent callers exactly one writes.
        ``keep_pinned`` returns the slot as a read lease that the caller must release.
        The tiered store's write-back holds it.
        """
        view = _byte_view(data)
        if len(view) > self.slot_size:
            with self._lock:
                self._rejected += 1
            return Insertion(False, False, None)
        if if_absent:
            with self._lock:
                if self._is_ready(key):
                    return Insertion(False, True, None)
                return self._fill(key, view, keep_pinned)
        return self._fill(key, view, keep_pinned)

    def _fill(self, key: ChunkKey, view: memoryview, keep_pinned: bool) -> Insertion:
        lease = self.reserve(key)
        if lease is None:
            return Insertion(False, False, None)
        try:
            lease.view[: len(view)] = view
        except BaseException:
            self.abort(lease)
            raise
        self.commit(lease, len(view), keep_pinned=keep_pinned)
        return Insertion(True, False, lease if keep_pinned else None)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        deleted = 0
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is None or self.pool.state(slot) != READY:
                    continue
                del self._index[key]
                self._policy.remove(key)
                self._retire(slot)
                deleted += 1
                if self.listener is not None:
                    self.listener.chunk_removed(key, self.name)
        return deleted

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        if namespace is not None:
            check_namespace(namespace)  # refused like the stores where it becomes a path
        with self._lock:
            pool = self.pool
            snapshot = [
                ChunkInfo(k, pool.length(s), self._mtime[s], self._atime[s])
                for k, s in self._index.items()
                if pool.state(s) == READY and (namespace is None or k.namespace == namespace)
            ]
        yield from snapshot

    def close(self) -> None:
        """Free the pool (and its shared-memory name). Outstanding leases become invalid."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self.pool.close()

    # --- TP shard assembly: what SlotLoans (chunkstore.cache._lending) asks of the cache -----

    def _spare_slot(self) -> int | None:
        """A free slot taken out of the cache, evicting by policy when none is free.
        ``None`` when every slot is pinned. The caller holds the lock."""
        if not self._free and not self._steal_slot(exclude=None):
            return None
        return self._free.pop()

    def _publish_sealed(self, slot: int, *, keep_pinned: bool) -> Adoption:
        """Publish the chunk sealed in a lent slot.
        The caller holds the lock and checked the slot.
        A key already cached is not published again, and the caller keeps the slot."""
        pool = self.pool
        key = pool.key_of(slot)
        assert key is not None
        if self._is_ready(key):
            return Adoption(key, False, None)
        size = pool.length(slot)
        pool.publish(slot, size)
        self._bytes_used += size
        self._mtime[slot] = self._atime[slot] = time.time()
        # A reservation of the key still WRITING (a speculative promotion) loses the index
        # entry, as when another reservation commits first; its commit or abort finishes it.
        self._index[key] = slot
        if key not in self._policy:
            self._readmit(key)
        self._link_parent(key, slot)
        if self.listener is not None:
            self.listener.chunk_stored(key, self.name)
        if not keep_pinned:
            return Adoption(key, True, None)
        generation, view = self._pin_for_reading(slot)
        return Adoption(key, True, Lease(self, key, slot, generation, view, writing=False))

    # --- internals (caller holds self._lock) --------------------------------------------------

    def _pin_for_reading(self, slot: int) -> tuple[int, memoryview]:
        """Pin a READY ``slot`` for a read lease.
        Returns its generation and the view of its chunk."""
        pool = self.pool
        pool.pin(slot)
        return pool.generation(slot), pool.view(slot)[: pool.length(slot)]

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"host cache {self.name!r} is closed")

    def _can_evict(self, key: Any) -> bool:
        slot = self._index[key]
        return self.pool.state(slot) == READY and self.pool.pins(slot) == 0

    def _allocate(self, key: ChunkKey) -> int | None:
        """A free slot for ``key``, admitting it to the policy. ``None`` if all are pinned."""
        self._reclaim_doomed()
        if key not in self._policy:
            try:
                victim = self._policy.admit(key, self._can_evict)
            except NoEvictableEntry:
                return None
            if victim is not None:
                self._evict(victim)
        if not self._free and not self._steal_slot(exclude=key):
            # Replaced or deleted-while-pinned slots hold the room the policy counted on.
            if self._index.get(key) is None:
                self._policy.remove(key)
            return None
        return self._free.pop()

    def _evict(self, victim: Any) -> None:
        slot = self._index.pop(victim)
        self._evictions += 1
        self._retire(slot)
        if self.listener is not None:
            self.listener.chunk_removed(victim, self.name)

    def _steal_slot(self, exclude: ChunkKey | None) -> bool:
        """Evict one more resident key to free a slot. False if every one is pinned.

        The policy picks the victim by its own rule, and ARC keeps a ghost of it.
        So slots lent ahead of time cost the same history as an ordinary eviction.
        """
        victim = self._policy.evict(
            lambda k: k != exclude and k in self._index and self._can_evict(k)
        )
        if victim is None:
            return False
        self._evict(victim)
        return bool(self._free)

    def _readmit(self, key: ChunkKey) -> None:
        try:
            victim = self._policy.admit(key, self._can_evict_other(key))
        except NoEvictableEntry:
            # Every other entry is pinned: the policy stays one short; lookups still work.
            log.debug("%s: could not re-admit %s to the policy", self.name, key.hex)
            return
        if victim is not None:
            self._evict(victim)

    def _link_parent(self, key: ChunkKey, slot: int) -> None:
        # Only chain-following policies pay for reading the header of a published chunk.
        if self._policy.follows_chains and key in self._policy:
            parent = chunk_parent(key, self.pool.view(slot)[: self.pool.length(slot)])
            if parent is not None:
                self._policy.link(key, parent)

    def _can_evict_other(self, key: ChunkKey) -> Any:
        return lambda k: k != key and self._can_evict(k)

    def _retire(self, slot: int) -> None:
        """Take a slot out of service: free now, or doom it until its pins are gone."""
        pool = self.pool
        if pool.state(slot) == READY:
            self._bytes_used -= pool.length(slot)
        if pool.pins(slot) == 0:
            pool.free(slot)
            self._doomed.discard(slot)
            self._free.append(slot)
        else:
            pool.doom(slot)
            self._doomed.add(slot)

    def _unpin(self, slot: int) -> None:
        with self.pool:
            remaining = self.pool.unpin(slot)
            if remaining == 0 and slot in self._doomed:
                self._retire(slot)

    def _reclaim_doomed(self) -> None:
        # Pins from other processes are dropped without telling us; look before allocating.
        if not self._doomed:
            return
        pool = self.pool
        for slot in [s for s in self._doomed if pool.pins(s) == 0 and pool.state(s) == DOOMED]:
            self._retire(slot)


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ConfigError("chunk data must be a C-contiguous buffer")
    return view.cast("B")


def _copy_into(buffer: Buffer, source: memoryview) -> int:
    target = memoryview(buffer)
    if target.readonly:
        raise ConfigError("get_into needs a writable buffer")
    if target.format != "B" or target.ndim != 1:
        target = target.cast("B")
    size = len(source)
    if len(target) < size:
        raise ConfigError(f"buffer of {len(target)} bytes is too small for a {size}-byte chunk")
    target[:size] = source
    return size
