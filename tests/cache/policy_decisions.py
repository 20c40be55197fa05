"""Decision logs of the host-cache policies over seeded workloads, and their recorded digests.

A *decision log* is everything a policy tells its caller while it replays a
stream of lookups, written as text and hashed (SHA-256): the hit or miss of
every lookup, every eviction victim in order, every refusal
(:class:`~chunkstore.cache.policy.NoEvictableEntry`), the answers of
``evict()`` and ``remove()``, snapshots of the resident keys in the policy's
own order, and at the end its lists, ghosts, long history and target ``p``.
Two policies with the same digest made the same decisions.

Streams: the simulator's ``gen-trace`` workloads (chat, system-prompts, rag,
agent; :func:`~chunkstore.simulator.generate.generate_trace`, 400 requests,
seed 0, each block's parent the block before it in its prompt), a stream of
chained misses (6000 uniform keys out of 1000, ``random.Random(13)``, runs
of 32 chained keys) and the same keys with no parents (``uniform``), each at
three capacities (2 %, 10 % and 40 % of the stream's unique keys). Two drivers per case:

* ``access``: ``policy.access(key, parent)``, the simulator's and the
  benchmark's hot path, with a snapshot of the resident keys every
  :data:`SNAPSHOT_EVERY` lookups (``access`` does not name its victims);
* ``admit``: ``hit()`` then ``admit(key, can_evict, parent=...)`` as the host
  cache calls them, with pins (a key admitted in the last three lookups, or a
  key divisible by 13 in the last 200, may not be evicted: chunks still being
  written), one key in five linked to its parent only after admission (as the
  host cache learns parents from chunk headers), an ``evict()`` every 37
  lookups and a ``remove()`` of the key read 5 lookups earlier every 53.

Policies: ``parc``, ``arc``, ``lru`` and ``parc`` without idle expiry
(``parc-no-expiry``, ``idle_margin=inf``); the last is there so that the test
can show idle expiry changes decisions in these streams, i.e. that the digests
cover it.

The digests in ``policy_decisions.json`` were recorded from the main branch's
policies (commit 3e88878) by running this module; a speed-up of ``parc`` kept
every one of them. The ``parc`` cases were then refreshed once, on purpose, when
``parc`` stopped sparing the admitted chunk's parent and its frequency step went
from 4 to 6 (the ARC and LRU digests did not change). Regenerate them only when a
policy's behaviour (or the trace generator) changes on purpose, from the
repository root::

    PYTHONPATH=. .venv/bin/python -m tests.cache.policy_decisions

and say in the commit why the decisions changed. ``input`` digests name the
streams themselves, so a changed generator shows up as such, not as a policy change.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from chunkstore.cache import ARCPolicy, LRUPolicy, NoEvictableEntry, PrefixARCPolicy
from chunkstore.cache.policy import CachePolicy
from chunkstore.simulator.generate import WORKLOADS, generate_trace

VECTORS = Path(__file__).with_name("policy_decisions.json")
REQUESTS = 400
FRACTIONS = (0.02, 0.1, 0.4)
SNAPSHOT_EVERY = 250
UNIFORM_LOOKUPS = 6000
UNIFORM_UNIVERSE = 1000
CHAINED_RUN = 32

POLICIES: dict[str, Callable[[int], CachePolicy]] = {
    "parc": PrefixARCPolicy,
    "arc": ARCPolicy,
    "lru": LRUPolicy,
    "parc-no-expiry": lambda capacity: PrefixARCPolicy(capacity, idle_margin=float("inf")),
}
DRIVERS = ("access", "admit")

Lookup = tuple[int, "int | None"]
"""(key, parent): one block lookup and the block before it in its chain (None: a chain's first)."""


@dataclass(frozen=True, slots=True)
class DecisionLog:
    """A replay's digest and the counts that make a mismatch readable."""

    digest: str
    """SHA-256 of the log text."""
    lookups: int
    """Lookups replayed."""
    hits: int
    """Lookups that hit."""
    evictions: int
    """Keys evicted (by admissions and ``evict()``)."""
    vetoes: int
    """Times ``can_evict`` refused a key (pins exercised)."""
    refusals: int
    """Admissions refused with NoEvictableEntry (every resident key pinned)."""

    def to_json(self) -> dict[str, object]:
        return {
            "digest": self.digest,
            "lookups": self.lookups,
            "hits": self.hits,
            "evictions": self.evictions,
            "vetoes": self.vetoes,
            "refusals": self.refusals,
        }


def workload_stream(workload: str) -> list[Lookup]:
    """Every block lookup of a generated trace, each with the block before it in its prompt."""
    out: list[Lookup] = []
    for request in generate_trace(workload, requests=REQUESTS, seed=0):
        parent = None
        for block in request.hash_ids:
            out.append((block, parent))
            parent = block
    return out


def uniform_keys() -> list[int]:
    rng = random.Random(13)
    return [rng.randrange(UNIFORM_UNIVERSE) for _ in range(UNIFORM_LOOKUPS)]


def chained_stream() -> list[Lookup]:
    """Uniform keys whose misses have parents (the benchmark's chained stream, smaller)."""
    return [(key, key - 1 if key % CHAINED_RUN else None) for key in uniform_keys()]


def unchained_stream() -> list[Lookup]:
    """The same keys with no parents at all (the benchmark's mixed stream, smaller)."""
    return [(key, None) for key in uniform_keys()]


def streams() -> Iterator[tuple[str, list[Lookup]]]:
    """(name, lookups) of every stream the vectors cover."""
    for workload in WORKLOADS:
        yield workload, workload_stream(workload)
    yield "chained-misses", chained_stream()
    yield "uniform", unchained_stream()


def capacities(stream: Sequence[Lookup]) -> list[int]:
    """:data:`FRACTIONS` of the stream's unique keys (at least 2 entries each)."""
    unique = len({key for key, _ in stream})
    return sorted({max(2, round(unique * f)) for f in FRACTIONS})


def stream_digest(stream: Sequence[Lookup]) -> str:
    return hashlib.sha256(repr(list(stream)).encode()).hexdigest()


def final_state(policy: CachePolicy) -> str:
    """The policy's lists at the end: resident order, and for the ARC family ghosts and ``p``."""
    parts = [f"resident={list(policy)}"]
    if isinstance(policy, ARCPolicy):
        parts += [f"t1={list(policy.t1)}", f"t2={list(policy.t2)}"]
        parts += [f"b1={list(policy.b1)}", f"b2={list(policy.b2)}", f"p={policy.p!r}"]
    if isinstance(policy, PrefixARCPolicy):
        parts.append(f"history={list(policy.history)}")
    return "\n".join(parts)


def replay_access(policy: CachePolicy, stream: Sequence[Lookup]) -> DecisionLog:
    """The ``access`` driver: hit bits, periodic resident snapshots, the final state."""
    log: list[str] = []
    bits: list[str] = []
    access = policy.access
    hits = 0
    misses_when_full = 0
    for index, (key, parent) in enumerate(stream, 1):
        full = len(policy) >= policy.capacity
        if access(key, parent):
            hits += 1
            bits.append("h")
        else:
            misses_when_full += full
            bits.append("m")
        if index % SNAPSHOT_EVERY == 0:
            log.append("".join(bits))
            bits.clear()
            log.append(f"@{index} {list(policy)}")
    log.append("".join(bits))
    log.append(final_state(policy))
    return _finish(log, len(stream), hits, misses_when_full, 0, 0)


class _Pins:
    """Keys that may not be evicted yet, and a count of the vetoes (see the module docstring)."""

    def __init__(self) -> None:
        self.until: dict[Hashable, int] = {}
        self.now = 0
        self.vetoes = 0

    def admitted(self, key: int) -> None:
        self.until[key] = self.now + (200 if key % 13 == 0 else 3)

    def can_evict(self, key: Hashable) -> bool:
        if self.until.get(key, -1) < self.now:
            return True
        self.vetoes += 1
        return False


def replay_admit(policy: CachePolicy, stream: Sequence[Lookup]) -> DecisionLog:
    """The ``admit`` driver: hits, victims, refusals, late links, evict() and remove()."""
    log: list[str] = []
    pins = _Pins()
    can_evict = pins.can_evict
    hits = evictions = refusals = 0
    for index, (key, parent) in enumerate(stream, 1):
        pins.now = index
        if policy.hit(key):
            hits += 1
            log.append("h")
        else:
            late_link = parent is not None and key % 5 == 0
            try:
                victim = policy.admit(key, can_evict, parent=None if late_link else parent)
            except NoEvictableEntry:
                refusals += 1
                log.append("x")
            else:
                pins.admitted(key)
                if late_link:
                    policy.link(key, parent)
                evictions += victim is not None
                log.append(f"m{victim!r}")
        if index % 37 == 0:
            victim = policy.evict(can_evict)
            evictions += victim is not None
            log.append(f"e{victim!r}")
        if index % 53 == 0 and index > 5:
            old = stream[index - 6][0]
            log.append(f"r{old!r}{policy.remove(old)}")
    log.append(final_state(policy))
    return _finish(log, len(stream), hits, evictions, pins.vetoes, refusals)


def _finish(
    log: list[str], lookups: int, hits: int, evictions: int, vetoes: int, refusals: int
) -> DecisionLog:
    digest = hashlib.sha256("\n".join(log).encode()).hexdigest()
    return DecisionLog(digest, lookups, hits, evictions, vetoes, refusals)


REPLAYS: dict[str, Callable[[CachePolicy, Sequence[Lookup]], DecisionLog]] = {
    "access": replay_access,
    "admit": replay_admit,
}


def record() -> dict[str, object]:
    """Every case's decision log, as ``policy_decisions.json`` holds them."""
    cases: dict[str, object] = {}
    inputs: dict[str, str] = {}
    for name, stream in streams():
        inputs[name] = stream_digest(stream)
        for capacity in capacities(stream):
            for policy, make in POLICIES.items():
                for driver, replay in REPLAYS.items():
                    log = replay(make(capacity), stream)
                    cases[f"{name}/{capacity}/{policy}/{driver}"] = log.to_json()
    return {
        "_comment": "Written by `python -m tests.cache.policy_decisions`; see that module.",
        "input": inputs,
        "cases": cases,
    }


def main() -> None:
    VECTORS.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {VECTORS}")


if __name__ == "__main__":
    main()
