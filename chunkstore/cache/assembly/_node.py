"""TP engines through the node service: every rank writes its heads into one shared slot.

A TP engine's ranks are separate processes, each holding some KV heads of every chunk.
Each rank ``reserve``s the chunk with its ``rank``, ``tp`` and ``engine`` identity.
The first reservation of a key by an engine takes a slot.
The engine's other ranks join it and get the same slot.
Parts of different engines never meet.
Two engines saving the same chunk at once assemble it in a slot each.
The later commit replaces the earlier copy, which holds the same content.
So a chunk never holds one engine's heads beside another's.
Their copies need not agree bit for bit.
And a rank of one engine must not complete, or abort, another engine's chunk.

Each rank writes its byte ranges, see :meth:`ChunkLayout.rank_ranges`, and commits its part.
When every rank has committed, the service seals the chunk.
It writes the header and checksum with the layout of its ``--spec``.
It then checks the chunk and publishes it.
A chunk is published whole or not at all.
A rank whose connection closes before its part is committed takes the whole chunk down.
The slot is given back.
The end of the session of any rank that joined the chunk before it is whole does the same.
A chunk still not whole :data:`MAX_AGE_S` after its first reservation is given up too.
Ranks decide to save on their own, and one may never join.
It may have found no room.
Or another engine published the chunk between the ranks' reservations.
The slot would otherwise be held as long as the other ranks' sessions last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chunkstore.backends.base import SupportsReserve
from chunkstore.cache._lease import Lease
from chunkstore.format import ChunkLayout, seal_chunk
from chunkstore.hashing import ChunkKey

MAX_AGE_S = 60.0
"""Seconds a chunk's ranks have, from the first reservation, to commit every part (they
reserve in the same engine step and commit after its device-to-host copies)."""


@dataclass(frozen=True, slots=True)
class RankPart:
    """What a TP rank's reservation holds: its part of one chunk."""

    key: ChunkKey
    """The chunk."""
    rank: int
    """The rank writing the part."""
    engine: bytes | None
    """The identity of the rank's engine.
    ``None`` is a 1.0 client that sent none. Such parts assemble among themselves."""

    @property
    def assembly(self) -> tuple[ChunkKey, bytes | None]:
        """Which assembly the part belongs to: one per chunk and engine."""
        return (self.key, self.engine)


@dataclass
class _Assembly:
    """One chunk being written by the ranks of one engine."""

    lease: Lease
    tp: int
    parent: bytes
    tokens: list[int]
    started: float
    """When the first rank reserved it (the tracker's clock)."""
    joined: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    owners: list[object] = field(default_factory=list)
    """The sessions of the ranks that joined.
    One ending before the chunk is whole gives it up.
    That is a rank that died after its part, before a slower rank joined."""


class NodeAssemblies:
    """The chunks TP ranks are writing through the node service. Thread-safe."""

    def __init__(
        self,
        reserving: SupportsReserve,
        layout: ChunkLayout,
        valid: Callable[[ChunkKey, Any], bool],
        *,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reserving = reserving
        self._layout = layout
        self._valid = valid
        self._max_age_s = max_age_s
        self._clock = clock
        self._open: dict[tuple[ChunkKey, bytes | None], _Assembly] = {}
        self._lock = threading.Lock()

    def join(
        self,
        part: RankPart,
        *,
        tp: int,
        parent: bytes,
        tokens: list[int],
        owner: object,
    ) -> list[int] | None:
        """``[slot, generation]`` for ``part``'s rank to write its heads of the chunk into.
        ``None`` when there is no room, or this rank of its engine joined already.
        ``None`` too when its engine is assembling the chunk with another ``tp``."""
        self.expire()
        with self._lock:
            assembly = self._open.get(part.assembly)
            if assembly is None:
                lease = self._reserving.reserve(part.key)
                if not isinstance(lease, Lease):
                    if lease is not None:
                        self._reserving.abort(lease)
                    return None
                assembly = _Assembly(lease, tp, parent, list(tokens), self._clock())
                self._open[part.assembly] = assembly
            elif assembly.tp != tp or part.rank in assembly.joined:
                return None
            assembly.joined.add(part.rank)
            assembly.owners.append(owner)
            return [assembly.lease.slot, assembly.lease.generation]

    def expire(self) -> int:
        """Give up the chunks not whole ``max_age_s`` after their first reservation.
        It runs on every reservation, and returns how many."""
        oldest = self._clock() - self._max_age_s
        with self._lock:
            keys = [k for k, a in self._open.items() if a.started < oldest]
            gone = [self._open.pop(k) for k in keys]
        for assembly in gone:
            self._reserving.abort(assembly.lease)
        return len(gone)

    def __len__(self) -> int:
        """Chunks being assembled now."""
        return len(self._open)

    def part_done(self, part: RankPart) -> bool:
        """Mark ``part`` written.
        The last part of its engine's chunk seals, checks and publishes the chunk.
        False when the assembly is gone, given up, or the sealed chunk fails its check."""
        key = part.key
        with self._lock:
            assembly = self._open.get(part.assembly)
            if assembly is None or part.rank not in assembly.joined:
                return False
            assembly.done.add(part.rank)
            if len(assembly.done) < assembly.tp:
                return True
            del self._open[part.assembly]
        view = assembly.lease.view
        size = self._layout.total_size
        seal_chunk(
            self._layout,
            view[:size],
            key=key.digest,
            parent=assembly.parent,
            namespace=key.namespace,
            tokens=assembly.tokens,
            verify_key=False,
        )
        if not self._valid(key, view[:size]):
            self._reserving.abort(assembly.lease)
            return False
        self._reserving.commit(assembly.lease, size)
        return True

    def owner_gone(self, owner: object) -> None:
        """A session ended: give up every chunk one of its ranks joined and that is not whole."""
        with self._lock:
            keys = [k for k, a in self._open.items() if any(o is owner for o in a.owners)]
            gone = [self._open.pop(k) for k in keys]
        for assembly in gone:
            self._reserving.abort(assembly.lease)

    def leave(self, part: RankPart) -> None:
        """``part``'s rank is gone before committing it: give its engine's chunk up."""
        with self._lock:
            assembly = self._open.get(part.assembly)
            if assembly is None or part.rank not in assembly.joined or part.rank in assembly.done:
                return
            del self._open[part.assembly]
        self._reserving.abort(assembly.lease)


__all__ = ["NodeAssemblies", "RankPart"]
