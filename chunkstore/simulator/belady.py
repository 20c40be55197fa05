"""Belady's MIN: the offline optimum the online policies are compared with.

It uses demand paging, like the online policies: every missed block is admitted.
When the cache is full, the resident block whose next use lies farthest ahead is evicted.
A block never used again counts as farthest.
No online policy that admits every miss can score more **block hits** on the same sequence.

**Prompt tokens saved** are the leading run of hits of each request.
The simulator counts MIN's hits for them the same way as any policy's.
MIN is nearly prefix-aware by construction.
Every request reads a chunk's parent just before the chunk.
So a parent's next use comes before its child's, and MIN evicts the child first.
The exception is a child that is the block being admitted.
Under demand paging it cannot be the victim.
So a chain longer than the free room can keep a chunk whose parent it evicted.
That is a hit outside the leading run.
MIN's *tokens saved* are therefore no proven optimum.
But ``MIN hits x block_tokens`` is a proven bound on every policy's tokens saved.
A request saves at most ``block_tokens`` per leading hit, and a leading hit is a hit.
No policy of the same capacity that admits every miss has more hits than MIN.
See :meth:`~chunkstore.simulator.replay.Simulation.tokens_saved_bound`.
The two differ most where a cache of a few blocks meets long shared chains.
See docs/benchmarks.md, "Tokens saved on traces".
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from chunkstore.errors import ConfigError


def next_uses(accesses: Sequence[Hashable]) -> list[int]:
    """For each position, the position of the same block's next access (``len`` if none)."""
    never = len(accesses)
    following: dict[Hashable, int] = {}
    out = [never] * len(accesses)
    for position in range(len(accesses) - 1, -1, -1):
        block = accesses[position]
        out[position] = following.get(block, never)
        following[block] = position
    return out


def belady_hits(accesses: Sequence[Hashable], capacity: int) -> list[bool]:
    """Hit (True) or miss per access under MIN with ``capacity`` blocks."""
    if capacity < 1:
        raise ConfigError(f"capacity must be at least 1 block, got {capacity}")
    upcoming = next_uses(accesses)
    resident: dict[Hashable, int] = {}  # block -> its next use
    # (-next use, tiebreak, block); entries made stale by a later access are skipped on pop.
    heap: list[tuple[int, int, Hashable]] = []
    hits = [False] * len(accesses)
    for position, block in enumerate(accesses):
        following = upcoming[position]
        if block in resident:
            hits[position] = True
        elif len(resident) >= capacity:
            while True:
                negative_next, _, victim = heapq.heappop(heap)
                if resident.get(victim) == -negative_next:
                    del resident[victim]
                    break
        resident[block] = following
        heapq.heappush(heap, (-following, position, block))
    return hits
