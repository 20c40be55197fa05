"""KV events benchmark: lag from a store into host memory to a subscriber, under a burst.

A writer thread puts ``--rate`` chunks a second, a millisecond's worth per call,
into a :class:`~chunkstore.cache.HostCache` (LRU, small slots, so evictions add
``BlockRemoved`` events to the stream) for ``--seconds``. The cache's listener is
an :class:`~chunkstore.events.EventBuffer`. A step thread drains it every
``--step-ms`` milliseconds (the cadence of an engine's scheduler step, where vLLM
collects ``take_events``) into one batch for an
:class:`~chunkstore.events.EventPublisher`.
An :class:`~chunkstore.events.EventSubscriber` in another process reads them. (The
benchmark's events carry the put time, in nanoseconds, in their first two token ids.)

Reported per run: events/s delivered, lag p50/p99 from the put to the subscriber
decoding its event (milliseconds), and events lost (sequence gaps no replay filled,
plus events published but never read). ``--runs`` repeats; a range is printed.
Nothing fails on a figure.

    python tools/bench_events.py [--rate 10000] [--seconds 3] [--runs 3] [--step-ms 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any


def _subscribe(ends: tuple[str, str], ready: Any, results: Any, expect: Any) -> None:
    """Subscriber process: read until ``expect`` (set by the parent) events arrived."""
    from chunkstore.events import EventSubscriber

    sub = EventSubscriber(ends[0], replay_endpoint=ends[1])
    lags: list[float] = []
    received = 0
    joined = False
    deadline = float("inf")
    while time.time() < deadline:
        got = sub.receive(timeout=0.05)
        if got and not joined:
            joined = True
            ready.set()
        now = time.time()
        for r in got:
            for event in r.batch.events:
                received += 1
                if event["type"] == "BlockStored":
                    put_ns = (event["token_ids"][0] << 32) | event["token_ids"][1]
                    lags.append(now - put_ns / 1e9)
        if expect.value >= 0 and deadline == float("inf"):
            deadline = time.time() + 10
        if expect.value >= 0 and received >= expect.value:
            break
    results.put((received, sub.lost, lags))
    sub.close()


def _run(rate: int, seconds: float, step_ms: float) -> dict[str, float]:
    from chunkstore.cache import HostCache
    from chunkstore.events import (
        EventBatch,
        EventBuffer,
        EventPublisher,
        block_removed,
        block_stored,
    )
    from chunkstore.hashing import ChunkKey

    slot = 4096
    cache = HostCache(slot, num_slots=max(rate // 4, 64), policy="lru", name="host")
    buffer = EventBuffer(1 << 20)
    cache.listener = buffer
    tmp = tempfile.mkdtemp(prefix="bench-events-")
    ends = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
    pub = EventPublisher(ends[0], replay_endpoint=ends[1])
    stop = threading.Event()
    published = 0
    put_ns: dict[bytes, int] = {}

    def step() -> None:
        nonlocal published
        while not stop.is_set() or len(buffer):
            time.sleep(step_ms / 1000)
            events: list[dict[str, Any]] = []
            for e in buffer.take():
                if e.stored:
                    t = put_ns.pop(e.key.digest, 0)
                    tokens = [t >> 32, t & 0xFFFFFFFF] + [0] * 14
                    events.append(block_stored([e.key.digest], None, tokens, 16, "CPU"))
                else:
                    events.append(block_removed([e.key.digest], "CPU"))
            if events:
                published += len(events)
                pub.publish(EventBatch(time.time(), events))

    ctx = mp.get_context("spawn")
    ready, results, expect = ctx.Event(), ctx.Queue(), ctx.Value("q", -1)
    reader = ctx.Process(target=_subscribe, args=(ends, ready, results, expect), daemon=True)
    reader.start()
    # Join first: PUB drops what it sends before a subscriber is connected.
    for _ in range(600):
        pub.publish(EventBatch(time.time(), []))
        if ready.wait(0.05):
            break
    stepper = threading.Thread(target=step, daemon=True)
    stepper.start()
    data = os.urandom(slot)
    total = int(rate * seconds)
    tick = 0.001
    per_tick = max(1, int(rate * tick))
    start = time.perf_counter()
    for i in range(0, total, per_tick):
        due = start + i / rate
        while time.perf_counter() < due:
            time.sleep(tick / 4)
        digests = [j.to_bytes(32, "big") for j in range(i, min(i + per_tick, total))]
        now = time.time_ns()
        put_ns.update((d, now) for d in digests)
        cache.put_many([(ChunkKey(d, "0" * 16), data) for d in digests])
    wrote = time.perf_counter() - start
    stop.set()
    stepper.join(15)
    pub.flush(10)
    expect.value = published
    received, gaps, lags = results.get(timeout=30)
    reader.join(10)
    pub.close()
    cache.close()
    lags.sort()
    return {
        "events_per_s": received / wrote,
        "stores_per_s": total / wrote,
        "p50_ms": 1000 * lags[len(lags) // 2] if lags else float("nan"),
        "p99_ms": 1000 * lags[int(len(lags) * 0.99)] if lags else float("nan"),
        "lost": float(gaps + max(0, published - received)),
        "events": float(received),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=10_000, help="chunks stored per second")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=5.0, help="engine step (ms)")
    args = parser.parse_args()
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        print("skipped: needs pyzmq and msgpack (pip install 'chunkstore[peer]')")
        return 0
    results = []
    for n in range(args.runs):
        r = _run(args.rate, args.seconds, args.step_ms)
        results.append(r)
        print(
            f"run {n + 1}: {r['events']:.0f} events ({r['stores_per_s']:.0f} stores/s), "
            f"{r['events_per_s']:.0f} events/s, "
            f"lag p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, lost {r['lost']:.0f}",
            flush=True,
        )

    def span(name: str, fmt: str) -> str:
        values = [r[name] for r in results]
        return f"{format(min(values), fmt)}-{format(max(values), fmt)}"

    print(
        f"{args.runs} runs at {args.rate} stores/s (step {args.step_ms:g} ms): "
        f"{span('events_per_s', '.0f')} events/s, lag p50 {span('p50_ms', '.1f')} ms, "
        f"p99 {span('p99_ms', '.1f')} ms, lost {span('lost', '.0f')}; "
        f"median p99 {statistics.median(r['p99_ms'] for r in results):.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
