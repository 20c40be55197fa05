"""TP shard assembly: the ranks of one engine write one chunk into one shared host slot.

With tensor parallelism every rank process holds only its KV heads.
A chunk holds all of them, since the format is TP-independent.
Shards are not gathered anywhere.
Every rank writes its heads straight into its byte ranges of the same slot of the shared
host pool, see :meth:`ChunkLayout.rank_ranges`.
The last writer seals the header.
The owner process publishes the chunk once.

Roles:

* The **owner** is an :class:`AssemblyOwner`, in vLLM the scheduler process.
  It owns the :class:`~chunkstore.cache.HostCache`, with its index and policy.
  Through a :class:`~chunkstore.tiering.TieredStore` it owns the write-back to
  secondary tiers.
* **Ranks** are :class:`ShardAssembler` objects, one per TP worker process.
  They attach the pool by name.

The owner *lends* slots instead of assigning one per key.
Ranks must not wait for a round trip to a busy process on every save.
And only the owner may run the replacement policy.
So the owner keeps a few free slots in state ``LENT``, evicting by policy ahead of time.
Ranks claim them on their own:

1. ``slot_for_write(key, parent=, tokens=)`` runs under the pool lock, a ``flock``.
   If a claim for ``key`` exists, the rank joins it by setting its bit in ``joined``.
   If the key is already cached or sealed, it returns ``None``.
   Otherwise it takes a ``LENT`` slot and moves it to state ``CLAIMED``.
   It records the key, TP size, the expected ``writers`` bitmask and the claim time in
   the slot's table entry.
   It records the seal arguments, parent and tokens, in the slot's header area.
   No shard write touches that area.
2. The rank copies its shard into ``claim.view`` without the lock.
   Nothing else writes those bytes, since rank ranges are disjoint.
   The slot cannot be reused while the rank's bit is in ``joined`` but not in ``done``.
3. ``mark_written(claim)`` sets the rank's bit in ``done``.
   The rank that completes ``writers`` moves the slot to ``SEALING``.
   Exactly one rank can.
   It seals the header and checksum outside the lock, then sets ``SEALED`` and wakes the owner.
   Some ranks write nothing: replica ranks, when TP is larger than the KV head count.
   For MLA, so do ranks other than 0.
   They are not in ``writers`` and get ``None``.
4. A datagram on an abstract Unix socket named after the pool wakes the owner.
   It also wakes every ``sweep_interval`` regardless, so a lost wake-up only delays.
   It adopts each ``SEALED`` slot into its index under the pool lock.
   That state change happens once per claim.
   So each chunk is queued for write-back exactly once.
   It then lends fresh slots.

Failures: the owner moves a claim to ``ABORTED`` when it is not sealed in ``claim_timeout``
seconds.
So does a claim whose rank called :meth:`ShardAssembler.abandon`.
An aborted slot is never published or readable.
It is taken back once no writer is still inside it.
A writer counts as gone when it finished.
It also counts as gone when the process registered for its rank no longer exists.
The pool header lists those processes in ``rank_pids``.
A new process attaching as that rank has the same effect.
So a crashed rank leaks nothing.
A slow rank that is still copying keeps the slot until it calls
:meth:`ShardAssembler.mark_written`, which then returns False.

Loads: :meth:`ShardAssembler.acquire` pins a READY slot against eviction from any
attached process.
:meth:`ShardAssembler.read_shard` copies just the rank's heads.
Reads from rank processes do not update the owner's policy.
The scheduler records the hit when it plans the load.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkstore.cache._lease import Lease
from chunkstore.cache._pool import (
    ABORTED,
    CLAIMED,
    LENT,
    MAX_RANKS,
    READY,
    SEALED,
    SEALING,
    SlotPool,
    StaleSlot,
)
from chunkstore.errors import ConfigError, FormatError, KeyMismatch
from chunkstore.format import ChunkLayout, decode_chunk, key_digest, read_header, seal_chunk
from chunkstore.hashing import ChunkKey

log = logging.getLogger(__name__)

_CLAIM_MAGIC = b"CSCLAIM1"
_CLAIM_HEAD = struct.Struct("<8s32sI")
"""Seal arguments kept in a claimed slot's header area: magic | parent | token count | tokens."""


def wake_address(pool_name: str) -> bytes:
    """The abstract Unix datagram address the owner of pool ``pool_name`` listens on."""
    return b"\0chunkstore-pool/" + pool_name.encode()


def writer_mask(layout: ChunkLayout, tp: int) -> int:
    """Bitmask of the ranks of ``tp`` that write bytes of a chunk (the rest are replicas)."""
    return sum(1 << r for r in range(tp) if layout.rank_ranges(r, tp, for_write=True))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an exited, unreaped process)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            stat = stat_file.read()
    except OSError:
        return True
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] not in (b"Z", b"X")


def _key_heads(pool: SlotPool) -> np.ndarray:
    # The first 8 digest bytes of every slot as one integer column: a key scan compares
    # one u64 per slot instead of 32 bytes.
    return pool.table["digest"][:, :8].view("<u8")[:, 0]


def _head_of(key: ChunkKey) -> int:
    return int(np.frombuffer(key.digest[:8], "<u8")[0])


def ranks_in(mask: int) -> list[int]:
    """The rank numbers whose bits are set in ``mask``."""
    return [r for r in range(MAX_RANKS) if mask >> r & 1]


@dataclass(frozen=True, slots=True)
class ShardAssemblerStats:
    """Counters of one rank's :class:`ShardAssembler`."""

    claimed: int
    """Claims this rank opened (it was the first rank for the key)."""
    joined: int
    """Claims this rank joined after another rank opened them."""
    sealed: int
    """Chunks this rank completed and sealed."""
    present: int
    """Writes skipped because the chunk was cached, sealed, or already written by this rank."""
    no_slot: int
    """Writes skipped because the owner had no slot lent out (host memory full of pins)."""
    aborted: int
    """Claims of this rank that ended without a published chunk (abandoned or timed out)."""


class ShardAssembler:
    """The rank side of TP shard assembly. See the module docstring.

    ``pool`` is the owner's pool name, or an open :class:`SlotPool`.
    A pool named here is attached here and detached on :meth:`close`.
    ``slot_wait`` is how long :meth:`slot_for_write` waits for the owner to lend a slot.
    It is in seconds, and 0 gives up at once.
    A skipped save is counted in ``no_slot``.
    ``mac_key`` is for authenticated layouts.
    ``pin_memory`` applies when attaching by name.
    ``None`` page-locks the mapping in this process when torch sees CUDA.
    That makes device copies fast, see :meth:`SlotPool.attach`.
    """

    def __init__(
        self,
        pool: SlotPool | str,
        layout: ChunkLayout,
        *,
        rank: int,
        tp: int,
        mac_key: bytes | None = None,
        slot_wait: float = 0.0,
        pin_memory: bool | None = False,
    ) -> None:
        if not 1 <= tp <= MAX_RANKS:
            raise ConfigError(f"tp must be in 1..{MAX_RANKS}, got {tp}")
        if not 0 <= rank < tp:
            raise ConfigError(f"rank must be in 0..{tp - 1}, got {rank}")
        if slot_wait < 0:
            raise ConfigError(f"slot_wait must be >= 0, got {slot_wait}")
        if (mac_key is not None) != layout.authenticated:
            raise ConfigError("pass mac_key exactly when the layout is authenticated")
        self._owns_pool = isinstance(pool, str)
        self.pool = SlotPool.attach(pool, pin_memory=pin_memory) if isinstance(pool, str) else pool
        """The shared slot pool."""
        if layout.total_size > self.pool.slot_size:
            if self._owns_pool:
                self.pool.close()
            raise ConfigError(
                f"chunks of this layout need {layout.total_size} B, the pool's slots hold "
                f"{self.pool.slot_size} B"
            )
        if _CLAIM_HEAD.size + 4 * layout.spec.chunk_tokens > layout.data_offset:
            raise ConfigError("the layout's header area cannot hold the seal arguments")
        self.layout = layout
        """Layout of every chunk written through this assembler."""
        self.rank = rank
        """This process's TP rank."""
        self.tp = tp
        """TP size of the engine."""
        self.mac_key = mac_key
        self.slot_wait = slot_wait
        self.writers = writer_mask(layout, tp)
        """Bitmask of the ranks that write bytes; a chunk is complete when all have marked."""
        self.writes = bool(self.writers >> rank & 1)
        """Whether this rank writes anything (False for head replicas, and MLA ranks > 0)."""
        self._bit = 1 << rank
        self._heads = _key_heads(self.pool)
        self._counts = dict.fromkeys(ShardAssemblerStats.__slots__, 0)
        self._counts_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._wake: bytes | None = None
        if self.pool.name is not None:
            self._wake = wake_address(self.pool.name)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with self.pool:
            previous = int(self.pool.rank_pids[rank])
            if previous not in (0, os.getpid()):
                if process_alive(previous):
                    log.warning(
                        "pool %s: rank %d was registered by live process %d; now %d",
                        self.pool.name,
                        rank,
                        previous,
                        os.getpid(),
                    )
                self._write_off_previous()
            self.pool.rank_pids[rank] = os.getpid()
        self._closed = False

    def _write_off_previous(self) -> None:
        """A new process for this rank: claims the previous one left unfinished are lost."""
        table = self.pool.table
        bit = np.uint64(self._bit)
        joined, done, state = table["joined"], table["done"], table["state"]
        for slot in np.flatnonzero((joined & ~done & bit) != 0):
            done[slot] = done[slot] | bit
            if state[slot] == CLAIMED:
                state[slot] = ABORTED

    @classmethod
    def attach(
        cls, name: str, layout: ChunkLayout, *, rank: int, tp: int, **options: Any
    ) -> ShardAssembler:
        """Attach the shared pool ``name`` as rank ``rank`` of ``tp``."""
        return cls(name, layout, rank=rank, tp=tp, **options)

    # --- writes -----------------------------------------------------------------------------

    def slot_for_write(self, key: ChunkKey, *, parent: bytes, tokens: Any) -> Lease | None:
        """This rank's claim on ``key``'s slot, or ``None``. Every rank gets the same slot.

        The claim is a write :class:`~chunkstore.cache.Lease`.
        Write the shard into its ``view`` with :meth:`write_shard`, then call
        :meth:`mark_written`.
        ``with claim:`` does that on a clean exit, and abandons it if the block raised.
        ``sealed`` says whether this rank's mark completed the chunk.

        ``parent`` and ``tokens`` are the seal arguments.
        ``parent`` is the previous key's digest, or the namespace root.
        ``tokens`` are the chunk's token ids.
        Every rank passes the same ones, and the first claimant's are kept.
        ``None`` means nothing for this rank to write.
        Either the key is cached or sealed already, or this rank already wrote it.
        Or this rank writes no bytes, see :attr:`writes`, or no slot was free.
        Raises :class:`~chunkstore.errors.KeyMismatch` when ``key`` is not
        BLAKE3(parent || tokens).
        """
        self._check_open()
        if not self.writes:
            return None
        token_array = np.ascontiguousarray(tokens, dtype="<u4")
        if token_array.shape != (self.layout.spec.chunk_tokens,):
            raise ConfigError(
                f"a chunk covers {self.layout.spec.chunk_tokens} tokens, got {token_array.size}"
            )
        parent = bytes(parent)
        if len(parent) != 32:
            raise ConfigError(f"parent must be a 32-byte digest, got {len(parent)} bytes")
        if key_digest(parent, token_array) != key.digest:
            raise KeyMismatch(f"key {key.hex[:16]} is not BLAKE3(parent || tokens)")
        deadline = time.monotonic() + self.slot_wait
        while True:
            with self.pool:
                outcome = self._claim_locked(key, parent, token_array)
            if isinstance(outcome, Lease):
                return outcome
            if outcome == "present":
                self._count("present")
                return None
            self._kick()
            if time.monotonic() >= deadline:
                self._count("no_slot")
                return None
            time.sleep(0.001)

    def _claim_locked(self, key: ChunkKey, parent: bytes, tokens: np.ndarray) -> Lease | str:
        pool = self.pool
        table = pool.table
        state = table["state"]
        namespace = bytes.fromhex(key.namespace)
        for found in np.flatnonzero(self._heads == _head_of(key)):
            slot = int(found)
            current = int(state[slot])
            if current not in (CLAIMED, SEALING, SEALED, READY):
                continue
            entry = table[slot]
            if entry["digest"].tobytes() != key.digest or entry["namespace"].tobytes() != namespace:
                continue
            if current != CLAIMED:
                return "present"
            if int(entry["tp"]) != self.tp:
                raise ConfigError(
                    f"chunk {key.hex[:16]} is being assembled at tp={int(entry['tp'])}; "
                    f"this rank runs at tp={self.tp}"
                )
            if int(entry["joined"]) & self._bit:
                return "present"
            entry["joined"] = int(entry["joined"]) | self._bit
            self._count("joined")
            return Lease(self, key, slot, int(entry["generation"]), self._view(slot), writing=True)
        lent = np.flatnonzero(state == LENT)
        if lent.size == 0:
            return "no_slot"
        slot = int(lent[0])
        entry = table[slot]  # a fresh claim on the first free loan
        entry["digest"] = np.frombuffer(key.digest, np.uint8)
        entry["namespace"] = np.frombuffer(namespace, np.uint8)
        entry["tp"] = self.tp
        entry["claimer"] = os.getpid()
        entry["joined"] = self._bit
        entry["done"] = 0
        entry["writers"] = self.writers
        # CLOCK_MONOTONIC is one clock for every process of a (Linux) host: the owner
        # compares it with its own to time the claim out.
        entry["claimed_at"] = time.monotonic()
        entry["length"] = self.layout.total_size
        entry["generation"] = int(entry["generation"]) + 1
        view = self._view(slot)
        record = _CLAIM_HEAD.pack(_CLAIM_MAGIC, parent, tokens.size)
        view[: len(record)] = record
        view[len(record) : len(record) + tokens.nbytes] = tokens.tobytes()
        state[slot] = CLAIMED
        self._count("claimed")
        return Lease(self, key, slot, int(entry["generation"]), view, writing=True)

    def mark_written(self, claim: Lease) -> bool:
        """This rank's shard is in place; True when this call completed and sealed the chunk.

        After the last writer's mark the chunk is sealed and the owner publishes
        it (host index, then write-back) exactly once. False when other writers
        are still missing, or when the claim was aborted meanwhile (timeout).
        """
        if claim.released:
            return claim.sealed
        pool = self.pool
        with pool:
            entry = pool.table[claim.slot]
            if int(entry["generation"]) != claim.generation:
                claim.released = True
                self._count("aborted")
                return False
            done = int(entry["done"]) | self._bit
            if int(entry["state"]) != CLAIMED:
                entry["done"] = done
                claim.released = True
                self._count("aborted")
                return False
            writers = int(entry["writers"])
            if done & writers != writers:
                entry["done"] = done
                claim.released = True
                return False
            # Exactly one rank gets here per claim; its own done bit waits for the seal, so
            # the owner cannot take the slot back while the header is being written.
            entry["state"] = SEALING
        try:
            self._seal(claim)
        except BaseException:
            with pool:
                entry = pool.table[claim.slot]
                if int(entry["generation"]) == claim.generation:
                    entry["done"] = int(entry["done"]) | self._bit
                    if int(entry["state"]) == SEALING:
                        entry["state"] = ABORTED
            claim.released = True
            self._count("aborted")
            self._kick()
            raise
        with pool:
            entry = pool.table[claim.slot]
            sealed = False
            if int(entry["generation"]) == claim.generation:
                entry["done"] = int(entry["done"]) | self._bit
                if int(entry["state"]) == SEALING:
                    entry["state"] = SEALED
                    sealed = True
        claim.released = True
        claim.sealed = sealed
        self._count("sealed" if sealed else "aborted")
        self._kick()
        return sealed

    def _seal(self, claim: Lease) -> None:
        view = claim.view
        magic, parent, count = _CLAIM_HEAD.unpack_from(view, 0)
        if magic != _CLAIM_MAGIC or count != self.layout.spec.chunk_tokens:
            raise StaleSlot(f"slot {claim.slot} lost its claim record")
        start = _CLAIM_HEAD.size
        tokens = np.frombuffer(view, "<u4", count=count, offset=start).copy()
        seal_chunk(
            self.layout,
            view,
            key=claim.key.digest,
            parent=parent,
            namespace=claim.key.namespace,
            tokens=tokens,
            mac_key=self.mac_key,
            verify_key=False,  # checked when the claim was made
        )

    def commit(self, claim: Lease) -> bool:
        """:meth:`mark_written` under the name every lease holder has (``with claim:``)."""
        return self.mark_written(claim)

    def abort(self, claim: Lease) -> None:
        """:meth:`abandon` under the name every lease holder has."""
        self.abandon(claim)

    def write_shard(self, claim: Lease, shard: Mapping[str, Any]) -> None:
        """Copy this rank's heads of every tensor into the claim (``ChunkLayout.write_shard``)."""
        self.layout.write_shard(claim.view, self.rank, self.tp, shard)

    def abandon(self, claim: Lease) -> None:
        """Give up: the chunk will not be published (other ranks' work is discarded too)."""
        if claim.released:
            return
        with self.pool:
            entry = self.pool.table[claim.slot]
            if int(entry["generation"]) == claim.generation:
                entry["done"] = int(entry["done"]) | self._bit
                if int(entry["state"]) == CLAIMED:
                    entry["state"] = ABORTED
        claim.released = True
        self._count("aborted")
        self._kick()

    # --- reads ------------------------------------------------------------------------------

    def acquire(self, key: ChunkKey) -> Lease | None:
        """Pin ``key``'s READY slot against eviction. ``None`` if host memory lacks it.
        Returns a read :class:`~chunkstore.cache.Lease`.
        Release it, or use ``with``, when done."""
        self._check_open()
        got = self.pool.acquire(key)
        if got is None:
            return None
        slot, view = got
        return Lease(self, key, slot, self.pool.generation(slot), view, writing=False)

    def release(self, lease: Lease) -> None:
        """Drop a read pin taken by :meth:`acquire`; idempotent."""
        if lease.writing:
            self.abandon(lease)
            return
        if not lease.released:
            lease.released = True
            if not self.pool.closed:
                self.pool.release(lease.slot)

    def read_shard(self, key: ChunkKey) -> dict[str, np.ndarray] | None:
        """A copy of this rank's heads of every tensor of ``key``; ``None`` on a miss.

        Only the rank's byte ranges are read of a plain chunk. A zstd chunk (host memory
        keeps one that carries a MAC as it came: see :mod:`chunkstore.format._hot`) is
        decoded first. A chunk of another layout is a miss.
        """
        lease = self.acquire(key)
        if lease is None:
            return None
        with lease:
            views = self._shard_views(key, lease.view)
            return None if views is None else {name: v.copy() for name, v in views.items()}

    def _shard_views(self, key: ChunkKey, data: memoryview) -> dict[str, np.ndarray] | None:
        """Views of this rank's heads in chunk ``data``, or None if not a chunk of this layout.
        For a compressed chunk they view its decoded payload."""
        try:
            if read_header(data).compression == "none":
                if len(data) != self.layout.total_size:
                    return None
                return self.layout.read_shard(data, self.rank, self.tp)
            # Host memory's bytes are trusted (no checksum, no MAC), as for a plain chunk.
            chunk = decode_chunk(
                data,
                verify=False,
                expected_key=key.digest,
                expected_fingerprint=self.layout.fingerprint,
            )
        except FormatError:
            return None
        whole = {slot.name: chunk.tensor(slot.name) for slot in self.layout.tensors}
        return self.layout.shard_of(whole, self.rank, self.tp)

    # --- lifetime ---------------------------------------------------------------------------

    def stats(self) -> ShardAssemblerStats:
        """A snapshot of this rank's counters."""
        with self._counts_lock:
            return ShardAssemblerStats(**self._counts)

    def close(self) -> None:
        """Unregister this rank and detach the pool (when attached here). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.pool.closed:
            with self.pool:
                if int(self.pool.rank_pids[self.rank]) == os.getpid():
                    self.pool.rank_pids[self.rank] = 0
        self._heads = None  # type: ignore[assignment]
        if self._sock is not None:
            self._sock.close()
        if self._owns_pool:
            self.pool.close()

    def __enter__(self) -> ShardAssembler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals --------------------------------------------------------------------------

    def _view(self, slot: int) -> memoryview:
        return self.pool.view(slot)[: self.layout.total_size]

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1

    def _kick(self) -> None:
        # A hint only: the owner also sweeps on a timer, so a lost datagram just delays.
        if self._sock is None or self._wake is None:
            return
        try:
            self._sock.sendto(b"!", socket.MSG_DONTWAIT, self._wake)
        except OSError:
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError(f"shard assembler for rank {self.rank} is closed")


__all__ = [
    "ShardAssembler",
    "ShardAssemblerStats",
    "process_alive",
    "ranks_in",
    "wake_address",
    "writer_mask",
]
