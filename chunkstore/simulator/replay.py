"""Replaying a trace through cache policies at several capacities.

Each request looks up its blocks in order.
A block is a hit if the cache holds it, and is admitted otherwise.
A serving engine does the same when it computes and saves the block.
Two results per policy and capacity:

* **Block hit ratio**: hits over all block lookups.
* **Tokens not recomputed**: per request, the tokens covered by its leading run of hits.
  KV for block i is only usable if blocks 0..i-1 are too.
  They are capped at the prompt length, and summed over requests.

Online policies are the real :class:`~chunkstore.cache.policy.CachePolicy` classes the
host cache runs.
They are told each block's chain parent, the block before it in the prompt.
The host cache learns it from chunk headers the same way.
``belady`` is the offline reference, see :mod:`chunkstore.simulator.belady`.
:meth:`Simulation.gap_to_belady` compares every policy with it on both results.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from chunkstore.cache.policy import POLICY_NAMES, make_policy
from chunkstore.errors import ConfigError
from chunkstore.simulator.belady import belady_hits
from chunkstore.simulator.trace import Trace

SIMULATED_POLICIES = (*POLICY_NAMES, "belady")
"""Policy names :func:`simulate` accepts."""
DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75)
"""Default capacities, as fractions of the trace's unique blocks."""


@dataclass(frozen=True, slots=True)
class PolicyResult:
    """One policy at one capacity."""

    policy: str
    """A host-cache policy name (``parc``, ``arc``, ``lru``) or ``belady``."""
    capacity: int
    """Cache size in blocks."""
    accesses: int
    """Block lookups."""
    hits: int
    """Lookups that hit."""
    tokens_saved: int
    """Prompt tokens whose KV came from the cache (leading hit runs)."""
    input_tokens: int
    """Prompt tokens over all requests."""

    @property
    def hit_ratio(self) -> float:
        """hits / accesses."""
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def tokens_saved_ratio(self) -> float:
        """tokens_saved / input_tokens."""
        return self.tokens_saved / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields, ratios included."""
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "accesses": self.accesses,
            "hits": self.hits,
            "hit_ratio": self.hit_ratio,
            "tokens_saved": self.tokens_saved,
            "input_tokens": self.input_tokens,
            "tokens_saved_ratio": self.tokens_saved_ratio,
        }


@dataclass(frozen=True, slots=True)
class Simulation:
    """Every policy at every capacity for one trace."""

    trace: Trace
    """The replayed trace."""
    capacities: tuple[int, ...]
    """Capacities in blocks, ascending."""
    policies: tuple[str, ...]
    """Simulated policies in the order asked."""
    results: tuple[PolicyResult, ...]
    """One per (capacity, policy)."""

    def result(self, policy: str, capacity: int) -> PolicyResult:
        """The result of ``policy`` at ``capacity``."""
        for entry in self.results:
            if entry.policy == policy and entry.capacity == capacity:
                return entry
        raise KeyError((policy, capacity))

    def gap_to_belady(self, policy: str, capacity: int) -> tuple[float, float] | None:
        """Belady's hit ratio and tokens-saved ratio minus ``policy``'s, in points of 1.0.

        ``None`` when Belady was not simulated. The tokens gap can be negative:
        Belady maximises block hits, not tokens saved (see :mod:`~chunkstore.simulator.belady`).
        """
        if "belady" not in self.policies:
            return None
        ours, best = self.result(policy, capacity), self.result("belady", capacity)
        return (
            best.hit_ratio - ours.hit_ratio,
            best.tokens_saved_ratio - ours.tokens_saved_ratio,
        )

    def tokens_saved_bound(self, capacity: int) -> float | None:
        """A proven upper bound on the tokens-saved ratio of any policy at ``capacity``.

        It is Belady's block hits times the block size, at most every prompt token.
        A request saves at most ``block_tokens`` per leading hit.
        A leading hit is a hit.
        No policy of ``capacity`` blocks that admits every miss scores more hits than MIN.
        ``None`` when Belady was not simulated.
        """
        if "belady" not in self.policies:
            return None
        best = self.result("belady", capacity)
        if not best.input_tokens:
            return 0.0
        bound = min(best.hits * self.trace.block_tokens, best.input_tokens)
        return bound / best.input_tokens


def default_capacities(unique_blocks: int) -> tuple[int, ...]:
    """:data:`DEFAULT_FRACTIONS` of the working set, at least one block each, deduplicated."""
    return tuple(sorted({max(1, round(unique_blocks * f)) for f in DEFAULT_FRACTIONS}))


def _replay(
    trace: Trace, hits_of: Sequence[bool] | None, policy: str, capacity: int
) -> PolicyResult:
    """Count hits and saved tokens; online policies are run here, MIN hits are given."""
    access = make_policy(policy, capacity).access if hits_of is None else None
    block_tokens = trace.block_tokens
    position = hits = saved = 0
    for request in trace.requests:
        leading = 0
        in_prefix = True
        parent = None  # each block's chain parent is the block before it in the prompt
        for block in request.blocks:
            if access is not None:
                hit = access(block, parent)
                parent = block
            else:
                hit = hits_of[position]  # type: ignore[index]
            position += 1
            if hit:
                hits += 1
                if in_prefix:
                    leading += 1
            else:
                in_prefix = False
        saved += min(leading * block_tokens, request.input_length)
    return PolicyResult(policy, capacity, position, hits, saved, trace.input_tokens)


def simulate(
    trace: Trace,
    capacities: Sequence[int] | None = None,
    policies: Sequence[str] = SIMULATED_POLICIES,
) -> Simulation:
    """Replay ``trace`` through each policy at each capacity (in blocks)."""
    chosen = tuple(dict.fromkeys(p.lower() for p in policies))
    unknown = [p for p in chosen if p not in SIMULATED_POLICIES]
    if unknown or not chosen:
        raise ConfigError(
            f"unknown policy {', '.join(unknown) or '(none)'}; "
            f"choose from {', '.join(SIMULATED_POLICIES)}"
        )
    if capacities:
        sizes = tuple(sorted(set(capacities)))
    else:
        sizes = default_capacities(trace.unique_blocks)
    if any(c < 1 for c in sizes):
        raise ConfigError(f"capacities must be at least 1 block, got {list(sizes)}")
    accesses: list[Hashable] | None = None
    results = []
    for capacity in sizes:
        for policy in chosen:
            if policy == "belady":
                if accesses is None:
                    accesses = [b for r in trace.requests for b in r.blocks]
                results.append(_replay(trace, belady_hits(accesses, capacity), policy, capacity))
            else:
                results.append(_replay(trace, None, policy, capacity))
    return Simulation(trace, sizes, chosen, tuple(results))
