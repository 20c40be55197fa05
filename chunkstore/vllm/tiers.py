"""The connector's view of storage: a TieredStore (host memory, then secondary tiers).

:class:`ConnectorStore` composes the core: a :class:`~chunkstore.cache.HostCache`
(tier 0, shared by name with the TP rank processes when TP > 1) in front of the
secondary tiers in a :class:`~chunkstore.tiering.TieredStore` (write-behind,
promotion, tier fail-over, ``chunkstore_*`` metrics), plus what is specific
to vLLM: non-blocking prefetch with per-chunk sources for the scheduler, write
slots for the worker, and the TP assembly owner. :class:`RankStore` is a TP
rank's side of the shared pool.

Every chunk reaches a device through host memory: a secondary-tier hit is
first prefetched into host memory (:meth:`ConnectorStore.submit_prefetch`),
and only then does the scheduler let vLLM allocate device blocks for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from chunkstore.backends import Store, ZstdStore
from chunkstore.backends._models import record_model
from chunkstore.backends._registry import open_for_option
from chunkstore.cache import DEFAULT_POLICY, AssemblyOwner, HostCache, ShardAssembler
from chunkstore.cache._lease import Lease
from chunkstore.errors import StoreError
from chunkstore.format import ChunkLayout, seal_chunk
from chunkstore.hashing import ChunkKey
from chunkstore.node import NodeReservation
from chunkstore.tiering import TieredStore
from chunkstore.vllm.metadata import ChunkSave

log = logging.getLogger(__name__)

__all__ = [
    "ConnectorStore",
    "NodeSlot",
    "PlainBuffer",
    "PrefetchResult",
    "RankStore",
    "SaveSlot",
    "WorkerStore",
    "flush_shared",
    "seal_save",
    "acquire_shared",
    "release_shared",
    "shared_names",
    "tier_open_options",
]


class _HostView:
    """The host cache as the scheduler and tests ask it: by key, host memory only."""

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
    """How many chunks (from the first key asked for) are now in host memory."""
    sources: list[str] = field(default_factory=list)
    """Per fetched chunk, where from: ``host`` (already there) or the tier's kind
    (``fs``, ``s3``, ``peer``, ...)."""
    corrupt: int = 0
    """Corrupt chunks found (and quarantined by the tiers) meanwhile."""


class ConnectorStore:
    """Host memory plus secondary tiers, as the connector uses them. Thread-safe.

    ``stores`` replaces ``tiers`` with already open stores (tests).
    ``compression="zstd"`` puts a :class:`~chunkstore.backends.ZstdStore` in front of
    each tier (host memory holds chunks uncompressed, ready to copy). ``shm_name``
    shares the host pool with TP rank processes and runs the assembly owner that
    publishes the chunks they write.
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
        """The secondary tiers, fastest first (as opened; the tiered store guards them)."""
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
        """The TP shard-assembly owner (``shm_name`` given): lends slots to rank processes,
        publishes what they seal once and queues it for write-back."""
        if shm_name is not None:
            self.owner = AssemblyOwner(self.tiered).start()
        self.closed = False

    # --- lookups -------------------------------------------------------------

    def host_run(self, keys: Sequence[ChunkKey], start: int = 0) -> int:
        """Index one past the last of the consecutive keys from ``start`` held in host memory."""
        return start + self.host.cache.lookup_prefix(list(keys[start:]))

    @property
    def tiers_are_fast(self) -> bool:
        """Whether every tier answers lookups locally (no per-request round trip)."""
        return not any(tier.high_latency for tier in self.tiers)

    def tier_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` host memory and the tiers hold (lookup only; errors miss)."""
        return self.tiered.lookup_prefix(keys)

    def submit_prefetch(self, keys: Sequence[ChunkKey]) -> Future[PrefetchResult]:
        """Bring the longest prefix of ``keys`` that some tier holds into host memory, on the
        tiered store's prefetch threads; the future never fails."""
        corrupt_before = self.tiered.corrupt_detected
        result: Future[PrefetchResult] = Future()

        def done(inner: Future[list[str]]) -> None:
            sources = inner.result()
            corrupt = self.tiered.corrupt_detected - corrupt_before
            result.set_result(PrefetchResult(len(sources), list(sources), corrupt))

        self.tiered.prefetch(keys).add_done_callback(done)
        return result

    # --- data ----------------------------------------------------------------

    @contextmanager
    def read_host(self, key: ChunkKey) -> Iterator[Any | None]:
        """The chunk's bytes in host memory, pinned meanwhile (None if absent)."""
        lease = self.host.cache.acquire(key)
        if lease is None:
            yield None
            return
        with lease:
            yield lease.view

    def read_check(self, data: Any) -> Callable[[], bool] | None:
        """None: this process's own pins hold until it releases them."""
        return None

    def reserve(self, key: ChunkKey) -> Lease | None:
        """A pinned host slot to write ``key`` into (``lease.view``), or None when every slot is
        pinned; finish with :meth:`commit` (queues the write-back) or :meth:`abort`."""
        return self.tiered.reserve(key)

    def commit(self, lease: Lease) -> None:
        """Publish a reserved slot in host memory and queue its write-back."""
        self.tiered.commit(lease)

    def abort(self, lease: Lease) -> None:
        """Give up a reservation; idempotent."""
        self.tiered.abort(lease)

    def save_slot(self, save: ChunkSave) -> Lease | PlainBuffer:
        """Where to write the whole chunk: a pinned host slot when the cache has room, else a
        plain buffer (stored with a copy)."""
        return self.reserve(save.key) or PlainBuffer(bytearray(self.layout.total_size))

    def save_done(self, save: ChunkSave, slot: SaveSlot) -> None:
        """Seal the chunk written into ``slot`` and keep it (host memory, then the tiers)."""
        seal_save(self.layout, slot.view, save)
        if isinstance(slot, Lease):
            self.commit(slot)  # in host memory now; written behind to the tiers
        else:
            self.put(save.key, slot.view)

    def save_abandoned(self, slot: SaveSlot) -> None:
        """Give up a slot from :meth:`save_slot` (nothing is stored)."""
        if isinstance(slot, Lease):
            self.abort(slot)

    def put(self, key: ChunkKey, data: Any) -> None:
        """Keep a sealed chunk in host memory and write it behind to every tier."""
        self.tiered.put(key, data)

    def drop(self, key: ChunkKey) -> None:
        """Forget ``key`` in host memory (a chunk that failed to load); tiers keep theirs."""
        self.host.delete(key)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything stored so far (and sealed by TP ranks) is written behind."""
        if self.owner is not None:
            self.owner.collect()  # chunks the ranks sealed but the owner thread has not seen
        self.tiered.flush(timeout)

    def reset_host(self) -> None:
        """Forget everything in host memory (secondary tiers keep their chunks)."""
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


class ChunkIdentity(Protocol):
    """What sealing a chunk needs to know of it: a :class:`ChunkSave`, or the native
    tier's ``ChunkAddress``."""

    @property
    def key(self) -> ChunkKey: ...
    @property
    def parent(self) -> bytes: ...
    @property
    def tokens(self) -> tuple[int, ...]: ...


def seal_save(layout: ChunkLayout, view: Any, save: ChunkIdentity) -> None:
    """Write the header and checksum of the chunk ``save`` names around the KV the worker
    copied into ``view`` (the whole chunk buffer)."""
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
    """A chunk buffer outside the host pool (every slot was pinned): stored by copy."""

    view: bytearray
    """The whole chunk's bytes."""


@dataclass(frozen=True, slots=True)
class NodeSlot:
    """A slot of the node service's pool, reserved for one chunk this engine saves."""

    view: memoryview
    """The whole writable slot in this process's mapping of the pool."""
    reservation: NodeReservation
    """The service's reservation (committed or aborted by the store)."""


SaveSlot = Lease | PlainBuffer | NodeSlot
"""Where a worker writes a chunk it saves: a host-pool slot, a rank's claim on a shared slot,
a node service's slot, or a plain buffer."""


class WorkerStore(Protocol):
    """What a worker connector needs of its store; :class:`ConnectorStore` (whole chunks, the
    process's own host cache) and :class:`RankStore` (a TP rank's heads in a shared slot) are
    both one, so the worker never asks which it has."""

    def read_host(self, key: ChunkKey) -> AbstractContextManager[Any | None]:
        """The chunk's bytes in host memory, pinned meanwhile; None if absent."""
        ...

    def read_check(self, data: Any) -> Callable[[], bool] | None:
        """For ``data`` from :meth:`read_host` (its context still open): a check to run once
        the copies out of it are complete (whether it held the chunk all along), or None when
        nothing can take the pin back meanwhile."""
        ...

    def save_slot(self, save: ChunkSave) -> SaveSlot | None:
        """Where to write the chunk ``save`` names, or None: nothing for this process to write."""
        ...

    def save_done(self, save: ChunkSave, slot: SaveSlot) -> None:
        """The bytes are in ``slot``: seal and keep the chunk (or this rank's part of it)."""
        ...

    def save_abandoned(self, slot: SaveSlot) -> None:
        """The copy into ``slot`` failed: give the slot up, nothing is stored."""
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


class RankStore:
    """A TP rank's view of its engine's shared host pool, which the scheduler process owns.

    Saves: :meth:`claim` gives this rank its part of a chunk's slot
    (:class:`~chunkstore.cache.ShardAssembler`); the last rank to mark its
    part written seals the chunk and the owner publishes it once. Loads:
    :meth:`read_host` pins a chunk's slot while the rank reads its heads.
    The pool is attached on first use: vLLM starts the workers before the
    scheduler that creates it.
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
        """The attached :class:`~chunkstore.cache.ShardAssembler`, or None while the pool is
        not there yet."""
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

    @contextmanager
    def read_host(self, key: ChunkKey) -> Iterator[Any | None]:
        """The chunk's bytes in the shared pool, pinned meanwhile; None if absent."""
        assembler = self.assembler()
        lease = assembler.acquire(key) if assembler is not None else None
        if lease is None:
            yield None
            return
        with lease:
            yield lease.view

    def read_check(self, data: Any) -> Callable[[], bool] | None:
        """None: a rank's pins on the shared pool hold until it releases them."""
        return None

    def save_slot(self, save: ChunkSave) -> Lease | None:
        """This rank's claim on the chunk's shared slot (write only this rank's heads), or None:
        nothing to write (cached already, written by this rank, a replica rank, or no slot
        free)."""
        assembler = self.assembler()
        if assembler is None:
            return None
        return assembler.slot_for_write(save.key, parent=save.parent, tokens=list(save.tokens))

    def save_done(self, save: ChunkSave, slot: SaveSlot) -> None:
        """This rank's part is in place; the last rank's mark seals the chunk and the owner
        publishes it."""
        assert isinstance(slot, Lease) and self._assembler is not None
        self._assembler.mark_written(slot)

    def save_abandoned(self, slot: SaveSlot) -> None:
        """Give up a claim (the chunk is not published)."""
        assert isinstance(slot, Lease) and self._assembler is not None
        self._assembler.abandon(slot)

    def drop(self, key: ChunkKey) -> None:
        """Nothing: only the owner may evict; a chunk that fails to load stays a load error."""

    def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for: the owner writes published chunks to the tiers."""

    def close(self) -> None:
        with self._lock:
            if self._assembler is not None:
                self._assembler.close()
                self._assembler = None


def tier_open_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """A directory tier is created on first use (a KV cache, not data to protect), unless the
    user's ``store_options`` say otherwise."""
    if "://" not in url or url.startswith("file://"):
        return {"create": True, **options}
    return dict(options)


class SharedStore(Protocol):
    """What the per-process registry of stores needs: a :class:`ConnectorStore`, or a
    :class:`~chunkstore.vllm.nodestore.NodeConnectorStore`."""

    closed: bool

    def flush(self, timeout: float | None = None) -> None:
        """Wait until what was saved so far is written behind."""
        ...

    def close(self) -> None:
        """Release what the store holds."""
        ...


S = TypeVar("S", bound=SharedStore)


@dataclass
class _SharedEntry:
    """One shared store and how many connectors use it."""

    store: SharedStore
    users: int = 0


# The registry the rule "every resource has one owner" allows: keyed by name, reference-counted,
# the store (host pool, tier threads, assembly owner, /dev/shm file) closed by its last user.
_SHARED: dict[str, _SharedEntry] = {}
_SHARED_LOCK = threading.Lock()


def acquire_shared(name: str, factory: Callable[[], S]) -> S:
    """The process's store for ``name`` (the engine id), made by ``factory()`` on first use;
    each call is one more user, who calls :func:`release_shared` when done.

    The scheduler and worker connectors of one engine live in the same process
    whenever TP is 1 (always, with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, and in
    the engine-core process of ``vllm serve``); they share host memory this way.
    """
    with _SHARED_LOCK:
        entry = _SHARED.get(name)
        if entry is None or entry.store.closed:
            entry = _SharedEntry(factory())
            _SHARED[name] = entry
        entry.users += 1
        return cast(S, entry.store)


def release_shared(name: str) -> None:
    """One user of the shared store ``name`` is done with it; the last one closes it (which
    removes its shared host pool from ``/dev/shm``). Unknown names are ignored."""
    with _SHARED_LOCK:
        entry = _SHARED.get(name)
        if entry is None:
            return
        entry.users -= 1
        if entry.users > 0:
            return
        del _SHARED[name]
    entry.store.close()


def shared_names() -> list[str]:
    """The names of the shared stores open in this process (none once every engine shut down)."""
    with _SHARED_LOCK:
        return sorted(_SHARED)


def flush_shared(timeout: float | None = None) -> None:
    """Wait for the write-behind of every shared store of this process (tests, benchmarks)."""
    with _SHARED_LOCK:
        stores = [entry.store for entry in _SHARED.values()]
    for store in stores:
        store.flush(timeout=timeout)
