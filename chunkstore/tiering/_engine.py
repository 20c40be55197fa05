"""What an engine adapter keeps its chunks in: host memory in front of the tiers.

An engine's workers write each chunk they save into a slot and seal it. They
read chunks from host memory while they copy them to the device. The
:class:`EngineCache` protocol is that interface, written once for all engines.

* :class:`ProcessCache`: this process's own host cache in front of a
  :class:`~chunkstore.tiering.TieredStore`. It prefetches for the scheduler.
  It can run the TP assembly owner. Its ranks then use a :class:`RankCache`.
* :class:`RankCache`: a TP rank's part of a shared host pool that another
  process owns.

The node service's engine caches implement the same protocol. They live in the
engine adapter that uses them. Their pool is reached over a socket. Every
chunk reaches a device through host memory. :meth:`ProcessCache.submit_prefetch`
first brings a secondary-tier hit into host memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from chunkstore.backends import Store, ZstdStore
from chunkstore.backends._models import record_model
from chunkstore.backends._registry import open_for_option
from chunkstore.cache import DEFAULT_POLICY, AssemblyOwner, HostCache, ShardAssembler
from chunkstore.cache._lease import Lease
from chunkstore.errors import StoreError
from chunkstore.format import ChunkLayout, seal_chunk
from chunkstore.hashing import ChunkKey
from chunkstore.tiering._tiered import TieredStore

log = logging.getLogger(__name__)

__all__ = [
    "ChunkIdentity",
    "EngineCache",
    "PlainBuffer",
    "PrefetchResult",
    "ProcessCache",
    "RankCache",
    "SaveSlot",
    "seal_save",
    "tier_open_options",
]


def tier_open_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Store options for ``url``: a directory tier is created on first use.

    The user's ``store_options`` may say otherwise.
    """
    if "://" not in url or url.startswith("file://"):
        # A KV cache, not data to protect.
        return {"create": True, **options}
    return dict(options)


class _HostView:
    """The host cache as the scheduler and tests query it: by key, in host memory only."""

    def __init__(self, cache: HostCache) -> None:
        self.cache = cache
        """The :class:`~chunkstore.cache.HostCache`."""

    def contains(self, key: ChunkKey) -> bool:
        return bool(self.cache.exists_many([key])[0])

    def get(self, key: ChunkKey) -> bytes | None:
        return self.cache.get_many([key])[0]

    def delete(self, key: ChunkKey) -> None:
        self.cache.delete_many([key])

    def clear(self) -> None:
        self.cache.delete_many([info.key for info in self.cache.list()])

    def __len__(self) -> int:
        return int(self.cache.stats().chunks)


@dataclass
class PrefetchResult:
    """What a prefetch brought into host memory."""

    fetched: int = 0
    """How many chunks, from the first key asked for, are now in host memory."""
    sources: list[str] = field(default_factory=list)
    """Per fetched chunk, its source: ``host`` or the tier's kind, such as ``fs``."""
    corrupt: int = 0
    """Corrupt chunks found meanwhile; the tiers quarantined them."""


class ChunkIdentity(Protocol):
    """What sealing a chunk needs to know of it: an engine adapter's save record."""

    @property
    def key(self) -> ChunkKey: ...
    @property
    def parent(self) -> bytes: ...
    @property
    def tokens(self) -> tuple[int, ...]: ...


def seal_save(layout: ChunkLayout, view: Any, save: ChunkIdentity) -> None:
    """Write the header and checksum of the chunk that ``save`` names.

    ``view`` is the whole chunk buffer. The worker copied the KV into it.
    """
    seal_chunk(
        layout,
        view,
        key=save.key.digest,
        parent=save.parent,
        namespace=save.key.namespace,
        tokens=list(save.tokens),
        verify_key=False,
    )


@dataclass(frozen=True, slots=True)
class PlainBuffer:
    """A chunk buffer outside the host pool, for when every slot is pinned.

    Storing it copies the bytes.
    """

    view: bytearray
    """The whole chunk's bytes."""


class SaveSlot(Protocol):
    """Where a worker writes a chunk it saves.

    It is a host-pool slot, a node service's slot or a :class:`PlainBuffer`.
    A host-pool slot is a :class:`Lease`. A rank's claim on a shared slot is a
    lease too.
    """

    @property
    def view(self) -> Any:
        """The whole chunk's writable bytes."""
        ...


class EngineCache(Protocol):
    """What an engine's worker needs of its chunks' home.

    :class:`ProcessCache` holds whole chunks in the process's own host cache.
    :class:`RankCache` holds a TP rank's heads in a shared slot. Both implement
    this protocol, and so do the node service's caches. The worker never asks
    which one it has.
    """

    def read_host(self, key: ChunkKey) -> AbstractContextManager[Any | None]:
        """The chunk's bytes in host memory, pinned meanwhile; None if absent."""
        ...

    def read_check(self, data: Any) -> Callable[[], bool] | None:
        """A check for ``data`` from :meth:`read_host`, while its context is still open.

        Run it once the copies out of ``data`` are complete. It says whether
        ``data`` held the chunk all along. None means nothing can take the pin
        back meanwhile.
        """
        ...

    def save_slot(self, save: ChunkIdentity) -> SaveSlot | None:
        """Where to write the chunk ``save`` names; None when this process has nothing to write."""
        ...

    def save_done(self, save: ChunkIdentity, slot: SaveSlot) -> None:
        """Seal and keep the chunk in ``slot``, or this rank's part of it."""
        ...

    def save_abandoned(self, slot: SaveSlot) -> None:
        """Give up ``slot`` after a failed copy; nothing is stored."""
        ...

    def drop(self, key: ChunkKey) -> None:
        """Forget a chunk that failed to load, where this process may."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Wait until what was saved so far is written behind."""
        ...

    def close(self) -> None:
        """Release what this store holds."""
        ...


class ProcessCache:
    """This process's host memory in front of the secondary tiers, for an engine.

    The class is thread-safe. Tests pass ``stores``, already open, in place of
    ``tiers``. ``compression="zstd"`` puts a
    :class:`~chunkstore.backends.ZstdStore` in front of each tier. Host memory
    holds chunks uncompressed, ready to copy. ``shm_name`` shares the host pool
    with TP rank processes. It also runs the assembly owner. The owner
    publishes the chunks the ranks write.
    """

    def __init__(
        self,
        *,
        host_bytes: int,
        layout: ChunkLayout,
        tiers: Sequence[str] = (),
        store_options: dict[str, dict[str, Any]] | None = None,
        compression: str = "none",
        stores: Sequence[Store] | None = None,
        policy: str = DEFAULT_POLICY,
        shm_name: str | None = None,
        metrics: Any = None,
    ) -> None:
        self.layout = layout
        """The chunk layout of every chunk saved through :meth:`save_slot`."""
        options = store_options or {}
        opened = (
            list(stores)
            if stores is not None
            else [
                open_for_option("tiers", u, **tier_open_options(u, options.get(u, {})))
                for u in tiers
            ]
        )
        self.tiers: list[Store] = opened
        """The secondary tiers, fastest first, as opened; the tiered store guards them."""
        for tier in opened:
            record_model(tier, layout.spec)  # so `chunkstore inspect` names the model
        cache = HostCache(
            layout, capacity_bytes=host_bytes, policy=policy, name="host", shm_name=shm_name
        )
        written = [ZstdStore(t) for t in opened] if compression == "zstd" else opened
        self.tiered = TieredStore(cache, written, metrics=metrics)
        """Host memory in front of the tiers: write-behind, promotion, metrics."""
        self.host = _HostView(cache)
        self.owner: AssemblyOwner | None = None
        """The TP shard-assembly owner, or None without ``shm_name``."""
        # The owner lends slots to rank processes. It publishes what they seal, once, and
        # queues it for write-back.
        if shm_name is not None:
            self.owner = AssemblyOwner(self.tiered).start()
        self.closed = False

    # --- lookups -------------------------------------------------------------

    def host_run(self, keys: Sequence[ChunkKey], start: int = 0) -> int:
        """The end index of the run of keys from ``start`` that host memory holds."""
        return start + self.host.cache.lookup_prefix(list(keys[start:]))

    @property
    def tiers_are_fast(self) -> bool:
        """Whether every tier answers lookups locally, with no per-request round trip."""
        return not any(tier.high_latency for tier in self.tiers)

    def tier_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` host memory and the tiers hold.

        It only looks up. Errors count as misses.
        """
        return self.tiered.lookup_prefix(keys)

    def submit_prefetch(self, keys: Sequence[ChunkKey]) -> Future[PrefetchResult]:
        """Bring the longest prefix of ``keys`` that some tier holds into host memory.

        The tiered store's prefetch threads do the work. The future never fails.
        """
        corrupt_before = self.tiered.corrupt_detected
        result: Future[PrefetchResult] = Future()

        def done(inner: Future[list[str]]) -> None:
            sources = inner.result()
            corrupt = self.tiered.corrupt_detected - corrupt_before
            result.set_result(PrefetchResult(len(sources), list(sources), corrupt))

        self.tiered.prefetch(keys).add_done_callback(done)
        return result

    # --- data ----------------------------------------------------------------

    def read_host(self, key: ChunkKey) -> AbstractContextManager[Any | None]:
        """The chunk's bytes in host memory, pinned meanwhile; None if absent."""
        return _pinned(self.host.cache.acquire(key))

    def read_check(self, data: Any) -> Callable[[], bool] | None:
        """Return None: this process's own pins hold until it releases them."""
        return None

    def reserve(self, key: ChunkKey) -> Lease | None:
        """A pinned host slot to write ``key`` into, or None when every slot is pinned.

        Write into ``lease.view``. Finish with :meth:`commit`, which queues the
        write-back, or with :meth:`abort`.
        """
        return self.tiered.reserve(key)

    def commit(self, lease: Lease) -> None:
        """Publish a reserved slot in host memory and queue its write-back."""
        self.tiered.commit(lease)

    def abort(self, lease: Lease) -> None:
        """Give up a reservation; a second call does nothing."""
        self.tiered.abort(lease)

    def save_slot(self, save: ChunkIdentity) -> Lease | PlainBuffer:
        """Where to write the whole chunk.

        It is a pinned host slot when the cache has room. Otherwise it is a plain
        buffer, which is stored by copy.
        """
        return self.reserve(save.key) or PlainBuffer(bytearray(self.layout.total_size))

    def save_done(self, save: ChunkIdentity, slot: SaveSlot) -> None:
        """Seal the chunk written into ``slot`` and keep it: host memory, then the tiers."""
        seal_save(self.layout, slot.view, save)
        if isinstance(slot, Lease):
            self.commit(slot)  # in host memory now; written behind to the tiers
        else:
            self.put(save.key, slot.view)

    def save_abandoned(self, slot: SaveSlot) -> None:
        """Give up a slot from :meth:`save_slot`; nothing is stored."""
        if isinstance(slot, Lease):
            self.abort(slot)

    def put(self, key: ChunkKey, data: Any) -> None:
        """Keep a sealed chunk in host memory and write it behind to every tier."""
        self.tiered.put(key, data)

    def drop(self, key: ChunkKey) -> None:
        """Forget ``key``, a chunk that failed to load, in host memory; tiers keep theirs."""
        self.host.delete(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything stored so far is written behind, including TP ranks' chunks."""
        if self.owner is not None:
            self.owner.collect()  # chunks the ranks sealed but the owner thread has not seen
        self.tiered.flush(timeout)

    def reset_host(self) -> None:
        """Forget everything in host memory; secondary tiers keep their chunks."""
        self.host.clear()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.owner is not None:
                self.owner.close()
        finally:
            self.tiered.close()


class RankCache:
    """A TP rank's view of its engine's shared host pool, which the scheduler process owns.

    On saves, :meth:`claim` gives this rank its part of a chunk's slot,
    through a :class:`~chunkstore.cache.ShardAssembler`. The last rank to mark
    its part written seals the chunk. The owner publishes it once. On loads,
    :meth:`read_host` pins a chunk's slot while the rank reads its heads. The
    pool is attached on first use. vLLM starts the workers before the
    scheduler that creates the pool.
    """

    def __init__(self, pool_name: str, layout: ChunkLayout, *, rank: int, tp: int) -> None:
        self.pool_name = pool_name
        self.layout = layout
        self.rank = rank
        self.tp = tp
        self._assembler: ShardAssembler | None = None
        self._lock = threading.Lock()
        self._warned = False

    def assembler(self) -> ShardAssembler | None:
        """The attached :class:`~chunkstore.cache.ShardAssembler`; None until the pool exists."""
        with self._lock:
            if self._assembler is None:
                try:
                    # pin_memory=None: page-locked in this process when torch sees CUDA.
                    self._assembler = ShardAssembler.attach(
                        self.pool_name, self.layout, rank=self.rank, tp=self.tp, pin_memory=None
                    )
                except StoreError as exc:
                    if not self._warned:
                        self._warned = True
                        log.info("chunkstore: rank %d: host pool not there yet: %s", self.rank, exc)
                    return None
            return self._assembler

    def read_host(self, key: ChunkKey) -> AbstractContextManager[Any | None]:
        """The chunk's bytes in the shared pool, pinned meanwhile; None if absent."""
        assembler = self.assembler()
        return _pinned(assembler.acquire(key) if assembler is not None else None)

    def read_check(self, data: Any) -> Callable[[], bool] | None:
        """Return None: a rank's pins on the shared pool hold until it releases them."""
        return None

    def save_slot(self, save: ChunkIdentity) -> Lease | None:
        """This rank's claim on the chunk's shared slot; write only this rank's heads.

        Returns None when there is nothing to write. The chunk may be cached
        already. This rank may have written it, or be a replica rank. Or no slot
        may be free.
        """
        assembler = self.assembler()
        if assembler is None:
            return None
        return assembler.slot_for_write(save.key, parent=save.parent, tokens=list(save.tokens))

    def save_done(self, save: ChunkIdentity, slot: SaveSlot) -> None:
        """Mark this rank's part as written.

        The last rank's mark seals the chunk. The owner then publishes it.
        """
        assert isinstance(slot, Lease) and self._assembler is not None
        self._assembler.mark_written(slot)

    def save_abandoned(self, slot: SaveSlot) -> None:
        """Give up a claim; the chunk is not published."""
        assert isinstance(slot, Lease) and self._assembler is not None
        self._assembler.abandon(slot)

    def drop(self, key: ChunkKey) -> None:
        """Do nothing: only the owner may evict."""
        # A chunk that fails to load stays a load error.

    def flush(self, timeout: float | None = None) -> None:
        """Return at once: the owner writes published chunks to the tiers."""

    def close(self) -> None:
        with self._lock:
            if self._assembler is not None:
                self._assembler.close()
                self._assembler = None


@contextmanager
def _pinned(lease: Lease | None) -> Iterator[Any | None]:
    """Yield ``lease``'s bytes, or None for no lease; release the pin after the block."""
    if lease is None:
        yield None
        return
    with lease:
        yield lease.view
