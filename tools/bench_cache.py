"""Host cache benchmarks: hit copy speed, policy overhead, simulator on the shared trace.

Prints ratios against baselines measured in the same run; never fails on a threshold.
Sizes are smaller than production (2-core CI box): 16 chunks of 4 MiB, 1M policy lookups.

    .venv/bin/python tools/bench_cache.py
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from chunkstore.cache import ARCPolicy, HostCache, LRUPolicy, TieredStore
from chunkstore.hashing import ChunkKey
from chunkstore.metrics import ChunkstoreMetrics

CHUNK_BYTES = 4 << 20
CHUNKS = 16
ROUNDS = 20
POLICY_ENTRIES = 100_000
LOOKUPS = 1_000_000
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def best_of(repeats: int, fn: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def bench_host_hits() -> None:
    keys = [ChunkKey(bytes([i]) * 32, "0" * 16) for i in range(CHUNKS)]
    payloads = [
        np.random.default_rng(i).integers(0, 256, CHUNK_BYTES, dtype=np.uint8)
        for i in range(CHUNKS)
    ]
    target = np.empty(CHUNK_BYTES, dtype=np.uint8)
    total = CHUNKS * ROUNDS * CHUNK_BYTES

    def numpy_copy() -> None:
        for _ in range(ROUNDS):
            for source in payloads:
                np.copyto(target, source)

    baseline = best_of(3, numpy_copy)
    print(f"numpy copy of the same bytes        {total / baseline / 2**30:7.2f} GiB/s  (baseline)")
    host = HostCache(CHUNK_BYTES, num_slots=CHUNKS)
    host.put_many(list(zip(keys, payloads)))

    def host_get_into() -> None:
        for _ in range(ROUNDS):
            for key in keys:
                host.get_into(key, target)

    seconds = best_of(3, host_get_into)
    print(
        f"HostCache.get_into (host hit)       {total / seconds / 2**30:7.2f} GiB/s  "
        f"{baseline / seconds:5.2f}x numpy  (goal >= 0.8x)"
    )
    host.close()
    tiered = TieredStore(
        HostCache(CHUNK_BYTES, num_slots=CHUNKS), [], metrics=ChunkstoreMetrics(CollectorRegistry())
    )
    tiered.put_many(list(zip(keys, payloads)))

    def tiered_get_into() -> None:
        for _ in range(ROUNDS):
            for key in keys:
                tiered.get_into(key, target)

    seconds = best_of(3, tiered_get_into)
    print(
        f"TieredStore.get_into (host hit)     {total / seconds / 2**30:7.2f} GiB/s  "
        f"{baseline / seconds:5.2f}x numpy  (with metrics)"
    )
    tiered.close()


def bench_policies() -> None:
    rng = random.Random(7)
    # Uniform keys over 1.25x the capacity: about 80% hits, 20% misses that evict.
    universe = int(POLICY_ENTRIES * 1.25)
    stream = [rng.randrange(universe) for _ in range(LOOKUPS)]
    hot = list(range(POLICY_ENTRIES)) * (LOOKUPS // POLICY_ENTRIES)
    rng.shuffle(hot)
    dict_baseline = {k: None for k in range(POLICY_ENTRIES)}

    def plain_dict() -> None:
        contains = dict_baseline.__contains__
        for key in hot:
            contains(key)

    baseline = best_of(3, plain_dict)
    print(f"dict membership test (baseline)     {LOOKUPS / baseline / 1e6:7.2f} M lookups/s")
    for cls in (ARCPolicy, LRUPolicy):
        policy = cls(POLICY_ENTRIES)
        for key in range(POLICY_ENTRIES):
            policy.access(key)

        def hits(p: ARCPolicy | LRUPolicy = policy) -> None:
            hit = p.hit
            for key in hot:
                hit(key)

        seconds = best_of(3, hits)
        rate = LOOKUPS / seconds / 1e6
        print(
            f"{cls.__name__:<10} hit() all hits        {rate:7.2f} M lookups/s  "
            f"{baseline / seconds:5.2f}x dict"
        )
        policy = cls(POLICY_ENTRIES)

        def mixed(p: ARCPolicy | LRUPolicy = policy) -> None:
            access = p.access
            for key in stream:
                access(key)

        seconds = best_of(2, mixed)
        counter = cls(POLICY_ENTRIES)
        hit_ratio = sum(map(counter.access, stream)) / LOOKUPS
        rate = LOOKUPS / seconds / 1e6
        print(
            f"{cls.__name__:<10} access() mixed        {rate:7.2f} M lookups/s  "
            f"{baseline / seconds:5.2f}x dict  ({hit_ratio:.0%} hits)"
        )


def bench_simulator() -> None:
    if not TRACE.exists():
        print(f"simulator: {TRACE} not found, skipped")
        return
    from chunkstore.simulator import load_trace, simulate

    started = time.perf_counter()
    trace = load_trace(TRACE)
    result = simulate(trace)
    seconds = time.perf_counter() - started
    print(
        f"simulator: {len(trace.requests)} requests, {trace.accesses} lookups, "
        f"{trace.unique_blocks} unique blocks, {len(result.results)} runs in {seconds:.1f} s"
    )
    print(
        f"{'capacity':>9} {'ARC hit%':>9} {'LRU hit%':>9} {'Belady%':>8} "
        f"{'ARC/LRU':>8} {'gap to Belady':>14}"
    )
    for capacity in result.capacities:
        arc, lru, opt = (result.result(p, capacity) for p in ("arc", "lru", "belady"))
        print(
            f"{capacity:>9} {arc.hit_ratio:9.2%} {lru.hit_ratio:9.2%} {opt.hit_ratio:8.2%} "
            f"{arc.hits / max(lru.hits, 1):8.3f} {opt.hit_ratio - arc.hit_ratio:13.2%}p"
        )


def main() -> int:
    print("== host hit copy ==")
    bench_host_hits()
    print("== policy overhead ==")
    bench_policies()
    print("== simulator (shared Mooncake trace) ==")
    bench_simulator()
    return 0


if __name__ == "__main__":
    sys.exit(main())
