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

``--shared`` measures the shared-store publisher instead (what ``chunkstore serve
--events`` runs): a writer process puts chunks into a filesystem store with a capacity
index (a redis-server of the benchmark's own on 127.0.0.1), and a
:class:`~chunkstore.events.StoreAnnouncer` over another object of that store follows the
index's change feed (its listing an hour away) and publishes what it reads, each chunk's
parent and tokens taken from its feed entry (the writer put them there). ``--shared-feed``
writes the chunks first and appends their entries at ``--rate``, as the writers of many
machines would; ``--names-only`` appends names alone (as a reconcile does), so the
publisher reads each chunk's header, and ``--place juicefs`` puts the store on a JuiceFS
volume: written through one mount, read through another. ``--floor`` publishes that feed
with no chunkstore code (redis-py, msgpack and pyzmq alone): a lower bound for any
publisher here.

``--held N`` measures instead the store announcer taking in N new chunks from a feed made
in memory: the full garbage collections that ran meanwhile, and the longest.

Reported per run: events/s delivered, lag p50/p99 from the put to the subscriber
decoding its event (milliseconds), and events lost (sequence gaps no replay filled,
plus events published but never read). ``--runs`` repeats; a range is printed.
Nothing fails on a figure.

    python tools/bench_events.py [--rate 10000] [--seconds 3] [--runs 3] [--step-ms 5]
    python tools/bench_events.py --shared [--rate 2000]
    python tools/bench_events.py --shared-feed [--names-only | --floor] [--place juicefs]
    python tools/bench_events.py --held 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_sharing's servers


def _subscribe(
    ends: tuple[str, str], ready: Any, results: Any, expect: Any, arrivals: bool = False
) -> None:
    """Subscriber process: read until ``expect`` (set by the parent) events arrived. The
    lag of a stored event is read from its tokens, or with ``arrivals`` left to the parent:
    the results then carry each stored digest's arrival time instead."""
    from chunkstore.events import EventSubscriber

    sub = EventSubscriber(ends[0], replay_endpoint=ends[1])
    arrived: dict[bytes, float] = {}
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
                if event["type"] != "BlockStored":
                    continue
                if arrivals:
                    arrived[event["block_hashes"][0]] = now
                else:
                    put_ns = (event["token_ids"][0] << 32) | event["token_ids"][1]
                    lags.append(now - put_ns / 1e9)
        if expect.value >= 0 and deadline == float("inf"):
            deadline = time.time() + 10
        if expect.value >= 0 and received >= expect.value:
            break
    results.put((received, sub.lost, arrived if arrivals else lags))
    sub.close()


class _Subscriber:
    """The subscriber process, joined live before anything is measured."""

    def __init__(self, pub: Any, ends: tuple[str, str], arrivals: bool = False) -> None:
        from chunkstore.events import EventBatch

        ctx = mp.get_context("spawn")
        self.ready, self.results, self.expect = ctx.Event(), ctx.Queue(), ctx.Value("q", -1)
        self.process = ctx.Process(
            target=_subscribe,
            args=(ends, self.ready, self.results, self.expect, arrivals),
            daemon=True,
        )
        self.process.start()
        # Join first: PUB drops what it sends before a subscriber is connected.
        for _ in range(600):
            pub.publish(EventBatch(time.time(), []))
            if self.ready.wait(0.05):
                break

    def finish(self, pub: Any, published: int) -> tuple[int, int, Any]:
        """Once ``published`` events went out: (received, lost by sequence, lags or
        arrivals)."""
        pub.flush(10)
        self.expect.value = published
        received, gaps, data = self.results.get(timeout=30)
        self.process.join(10)
        return received, gaps, data


def _figures(
    received: int, gaps: int, published: int, total: int, wrote: float, lags: list[float]
) -> dict[str, float]:
    """One run's figures: rates over ``wrote`` seconds, lag percentiles, events lost."""
    lags = sorted(lags)
    return {
        "events_per_s": received / wrote,
        "stores_per_s": total / wrote,
        "p50_ms": 1000 * lags[len(lags) // 2] if lags else float("nan"),
        "p99_ms": 1000 * lags[int(len(lags) * 0.99)] if lags else float("nan"),
        "lost": float(gaps + max(0, published - received)),
        "events": float(received),
        "drained_per_s": float("nan"),
    }


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

    reader = _Subscriber(pub, ends)
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
    received, gaps, lags = reader.finish(pub, published)
    pub.close()
    cache.close()
    return _figures(received, gaps, published, total, wrote, lags)


@functools.cache
def _small_model() -> tuple[Any, bytes, Any]:
    """A small model of 16-token chunks: its layout, namespace root and one KV payload."""
    import numpy as np

    from chunkstore.format import ChunkLayout
    from chunkstore.hashing import namespace_root
    from chunkstore.testing.factories import kv_tensors, small_spec

    layout = ChunkLayout(small_spec(16))
    return layout, namespace_root(layout.fingerprint), kv_tensors(layout, np.zeros(16))


def _first_chunk(tokens: list[int]) -> tuple[Any, bytes]:
    """The key and bytes of a conversation's first chunk of the small model (8 KiB)."""
    import numpy as np

    from chunkstore.format import encode_chunk
    from chunkstore.hashing import chain_keys

    layout, root, tensors = _small_model()
    covered = np.array(tokens, dtype=np.uint32)
    key = chain_keys(covered, root=root, chunk_tokens=16)[0]
    data = encode_chunk(
        layout,
        key=key.digest,
        parent=root,
        namespace=key.namespace,
        tokens=covered,
        tensors=tensors,
    )
    return key, bytes(data)


def _shared_writer(root: str, url: str, rate: int, seconds: float, first: int, done: Any) -> None:
    """Writer process: ``rate`` chunks a second into the indexed store, a millisecond's
    worth per ``put_many``; each chunk's first two tokens are its put time (ns), the third
    its number (from ``first``)."""
    from chunkstore.backends._fs import FsStore

    store = FsStore(root, index=url)
    total = int(rate * seconds)
    per_tick = max(1, rate // 1000)
    start = time.perf_counter()
    for i in range(0, total, per_tick):
        due = start + i / rate
        while time.perf_counter() < due:
            time.sleep(0.00025)
        now = time.time_ns()
        store.put_many(
            [
                _first_chunk([now >> 32, now & 0xFFFFFFFF, first + j] + [0] * 13)
                for j in range(i, min(i + per_tick, total))
            ]
        )
    wrote = time.perf_counter() - start
    store.close()  # sends what the index has queued
    done.put((total, wrote))


def _watched(root: str, url: str) -> tuple[Any, Any]:
    """The store at ``root`` as serve's announcer opens it (its reads record no uses), and
    the ``describe`` it announces with."""
    from chunkstore.backends._fs import FsStore
    from chunkstore.cli.storeaccess import header_reader

    store = FsStore(root, index=url, track_access=False)
    read = header_reader(store)

    def describe(key: Any) -> tuple[bytes, list[int]] | None:
        header = read(key)
        return None if header is None else (header.parent, list(header.tokens))

    return store, describe


def _wait_held(announcer: Any, total: int) -> None:
    deadline = time.monotonic() + 30
    while announcer.held < total and time.monotonic() < deadline:
        time.sleep(0.05)
    announcer.close()


def _run_shared(rate: int, seconds: float, writers: int) -> dict[str, float]:
    from bench_sharing import redis_server

    from chunkstore.backends._fs import FsStore
    from chunkstore.events import EventPublisher, StoreAnnouncer

    tmp = tempfile.mkdtemp(prefix="bench-events-shared-")
    with redis_server(Path(tmp)) as port:
        url = f"redis://127.0.0.1:{port}/0"
        root = os.path.join(tmp, "store")
        FsStore(root, create=True, index=url).close()
        watched, describe = _watched(root, url)
        ends = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
        pub = EventPublisher(ends[0], replay_endpoint=ends[1])
        announcer = StoreAnnouncer([watched], pub, describe, interval=3600).start()
        reader = _Subscriber(pub, ends)
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        procs = [
            ctx.Process(
                target=_shared_writer,
                args=(root, url, rate // writers, seconds, n << 24, done),
            )
            for n in range(writers)
        ]
        for proc in procs:
            proc.start()
        reports = [done.get(timeout=seconds * 20 + 60) for _ in procs]
        for proc in procs:
            proc.join(30)
        total = sum(n for n, _ in reports)
        _wait_held(announcer, total)
        received, gaps, lags = reader.finish(pub, announcer.followed)
        figures = _figures(received, gaps, total, total, max(t for _, t in reports), lags)
        figures["drained_per_s"] = _drain_rate(watched, pub, describe, total)
        pub.close()
        watched.close()
    return figures


def _inject(url: str, feed: str, entries: list[dict[str, Any]], rate: int, done: Any) -> None:
    """Feed process: append ``entries`` to the change feed at ``rate`` a second, as the
    index's scripts do for the writers of many machines; the times each went in."""
    import redis

    from chunkstore.backends._index_scripts import FEED_LENGTH

    client = redis.Redis.from_url(url)
    per_tick = max(1, rate // 1000)
    times: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(entries), per_tick):
        due = start + i / rate
        while time.perf_counter() < due:
            time.sleep(0.00025)
        pipe = client.pipeline(transaction=False)
        for entry in entries[i : i + per_tick]:
            pipe.xadd(feed, entry, maxlen=FEED_LENGTH, approximate=True)
        now = time.time()
        pipe.execute()
        times += [now] * len(entries[i : i + per_tick])
    done.put((times, time.perf_counter() - start))


def _run_injected(
    rate: int, seconds: float, links: bool, place: str, floor: bool = False
) -> dict[str, float]:
    """The shared-store publisher at ``rate`` stores a second: chunks written beforehand,
    their feed entries appended at ``rate``, as many machines' writers would make them:
    each with the chunk's parent and tokens (``d``), or with ``links=False`` its name alone,
    so the publisher reads each header. ``place`` ``juicefs``: the chunks are written
    through one JuiceFS mount and the publisher reads through another."""
    from bench_sharing import juicefs_mounts, redis_server

    from chunkstore.events import EventPublisher, StoreAnnouncer

    total = int(rate * seconds)
    tmp = tempfile.mkdtemp(prefix="bench-events-feed-")
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(redis_server(Path(tmp)))
        url = f"redis://127.0.0.1:{port}/0"
        written = watched_root = os.path.join(tmp, "store")
        if place == "juicefs":
            mounts = stack.enter_context(juicefs_mounts(Path(tmp), port))
            if mounts is None:
                raise RuntimeError("JuiceFS is not installed")
            written, watched_root = str(mounts[0] / "store"), str(mounts[1] / "store")
        # What the benchmark keeps is bytes and strings, which the collector does not walk,
        # so its collections cost what serve's would.
        made = _prewrite(written, total)
        digests = [key.digest for key, _ in made]
        entries = [{"s": key.path, "d": link} if links else {"s": key.path} for key, link in made]
        del made
        watched, describe = _watched(watched_root, url)
        feed = watched.index.feed()
        ends = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
        if floor:
            pub: Any = _FloorPublisher(ends)
            reader = _Subscriber(pub, ends, arrivals=True)
            follower = threading.Thread(target=pub.follow, args=(url, feed.key, total))
            follower.start()
            time.sleep(0.2)  # its first read is waiting at the stream's end
        else:
            pub = EventPublisher(ends[0], replay_endpoint=ends[1])
            announcer = StoreAnnouncer([], pub, describe, interval=3600)
            announcer.feeds = [feed]  # the store is not listed: all comes by its feed
            announcer.start()
            reader = _Subscriber(pub, ends, arrivals=True)
        done = mp.get_context("spawn").Queue()
        feeder = mp.get_context("spawn").Process(
            target=_inject, args=(url, feed.key, entries, rate, done)
        )
        feeder.start()
        times, wrote = done.get(timeout=seconds * 20 + 60)
        feeder.join(30)
        if floor:
            follower.join(30)
            published = pub.sent
        else:
            _wait_held(announcer, total)
            published = announcer.followed
        received, gaps, arrived = reader.finish(pub, published)
        pub.close()
        watched.close()
    lags = [arrived[d] - t for d, t in zip(digests, times) if d in arrived]
    return _figures(received, gaps, total, total, wrote, lags)


def _run_growth(count: int) -> dict[str, float]:
    """The store announcer taking in ``count`` new chunks from a change feed made in memory
    (no Redis, no socket: the batches go nowhere), 1,000 to a read, as ``chunkstore serve
    --events`` does when a store fills: the full garbage collections that ran meanwhile,
    the longest one, and the chunks taken in a second."""
    import gc

    import blake3

    from chunkstore.backends._feed import FeedRead
    from chunkstore.events import StoreAnnouncer
    from chunkstore.hashing import ChunkKey

    parent = bytes(32)

    class Feed:
        errors = 0
        made = 0

        def read(self, timeout: float) -> FeedRead:
            out = FeedRead()
            for n in range(self.made, min(self.made + 1000, count)):
                link = parent + n.to_bytes(4, "little") + bytes(60)  # 16 tokens
                key = ChunkKey(blake3.blake3(link).digest(), "0" * 16)
                out.changes.append((True, key))
                out.links[key] = link
            self.made += len(out.changes)
            return out

    class Nowhere:
        def publish(self, batch: Any) -> None:
            pass

    pauses: list[float] = []
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - began[0])

    announcer = StoreAnnouncer([], Nowhere(), lambda key: None, interval=3600)
    announcer.feeds = [Feed()]
    gc.collect()
    gc.callbacks.append(timed)
    try:
        start = time.perf_counter()
        while announcer.held < count:
            announcer.follow(0)
        took = time.perf_counter() - start
    finally:
        gc.callbacks.remove(timed)
    return {
        "full_collections": float(len(pauses)),
        "longest_ms": 1000 * max(pauses, default=0.0),
        "total_ms": 1000 * sum(pauses),
        "per_s": count / took,
    }


class _FloorPublisher:
    """The floor of ``--shared-feed``, with no chunkstore code: redis-py reads the feed
    (XREAD, blocking), each ``s`` entry's parent and tokens become a ``BlockStored`` map,
    msgpack packs the batch and a ZeroMQ PUB socket sends it in vLLM's framing (topic,
    8-byte sequence number, payload), with the fields the announcer's events carry. Nothing
    is checked or remembered: no BLAKE3, no held set, no replay buffer, no listing, no queue
    to a sending thread. So it is a lower bound. :meth:`publish` (empty batches, to join
    the subscriber) and :meth:`flush` are what :class:`_Subscriber` calls."""

    def __init__(self, ends: tuple[str, str]) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._pub, self._replay = self._ctx.socket(zmq.PUB), self._ctx.socket(zmq.ROUTER)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(ends[0])
        self._replay.bind(ends[1])  # the subscriber connects; with no gap it never asks
        self._seq = 0
        self.sent = 0
        """Events sent."""

    def _send(self, events: list[dict[str, Any]]) -> None:
        import msgpack

        payload = msgpack.packb([time.time(), events], use_bin_type=True)
        self._pub.send_multipart((b"", self._seq.to_bytes(8, "big"), payload))
        self._seq += 1

    def publish(self, batch: Any) -> None:
        self._send(list(batch.events))

    def flush(self, timeout: float) -> bool:
        return True  # every send is done in the caller's thread

    def follow(self, url: str, feed: str, total: int) -> None:
        """Read ``feed`` from its end and publish until ``total`` stored entries went out."""
        import struct

        import redis

        client = redis.Redis.from_url(url)
        last: Any = "$"
        while self.sent < total:
            answer = client.xread({feed: last}, count=1000, block=100)
            if not answer:
                continue
            events = []
            for raw_id, fields in answer[0][1]:
                last = raw_id
                link, name = fields.get(b"d"), fields.get(b"s")
                if link is None or name is None:
                    continue
                tokens = list(struct.unpack_from(f"<{(len(link) - 32) // 4}I", link, 32))
                events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [bytes.fromhex(name[-68:-4].decode())],
                        "parent_block_hash": link[:32],
                        "token_ids": tokens,
                        "block_size": len(tokens),
                        "lora_id": None,
                        "medium": "STORAGE",
                        "lora_name": None,
                        "extra_keys": [("namespace", name[:16].decode())],
                        "ownership": "shared",
                    }
                )
            if events:
                self._send(events)
                self.sent += len(events)
        client.close()

    def close(self) -> None:
        self._pub.close(linger=2000)
        self._replay.close(0)
        self._ctx.term()


def _prewrite(root: str, count: int) -> list[tuple[Any, bytes]]:
    """``count`` small chunks written into a new store at ``root`` (no index); each one's
    key and the parent and tokens its feed entry carries."""
    from chunkstore.backends._fs import FsStore
    from chunkstore.format import chain_link

    store = FsStore(root, create=True)
    made = []
    for start in range(0, count, 500):
        items = [
            _first_chunk([j >> 16, j & 0xFFFF] + [7] * 14)
            for j in range(start, min(start + 500, count))
        ]
        made += [(key, chain_link(data) or b"") for key, data in items]
        store.put_many(items)
    store.close()
    return made


def _drain_rate(store: Any, pub: Any, describe: Any, total: int) -> float:
    """Events a second a new announcer publishes while it reads the whole feed again from
    its start, with no writer beside it: what the publisher alone can keep up with."""
    from chunkstore.backends._feed import ChangeFeed
    from chunkstore.events import StoreAnnouncer

    announcer = StoreAnnouncer([store], pub, describe, interval=3600)
    feed = announcer.feeds[0]
    announcer.feeds = [ChangeFeed(feed.client, feed.key, from_start=True)]
    start = time.perf_counter()
    for _ in range(10 * total):
        if announcer.held >= total:
            break
        announcer.follow(0.01)
    return announcer.held / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=10_000, help="chunks stored per second")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=5.0, help="engine step (ms)")
    parser.add_argument(
        "--shared",
        action="store_true",
        help="the shared-store publisher, following a capacity index's change feed "
        "(needs redis-server)",
    )
    parser.add_argument(
        "--writers", type=int, default=2, help="writer processes with --shared (default 2)"
    )
    parser.add_argument(
        "--shared-feed",
        action="store_true",
        help="the shared-store publisher at --rate: chunks written first, their feed entries "
        "then appended at --rate, as the writers of many machines would (needs redis-server)",
    )
    parser.add_argument(
        "--names-only",
        action="store_true",
        help="with --shared-feed: entries name their chunk alone (as a reconcile's do), so "
        "the publisher reads each chunk's header",
    )
    parser.add_argument(
        "--place",
        choices=("local", "juicefs"),
        default="local",
        help="with --shared-feed: where the store is; juicefs writes through one mount and "
        "publishes through another",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="with --shared-feed: the same feed, feeder and subscriber, published by a bare "
        "redis-py/msgpack/pyzmq loop with no chunkstore code (what any publisher costs here)",
    )
    parser.add_argument(
        "--held",
        type=int,
        metavar="N",
        help="instead: the store announcer taking in N new chunks from a feed made in memory; "
        "prints the full garbage collections meanwhile and the longest",
    )
    args = parser.parse_args()
    if args.held is not None:
        if args.held < 1:
            parser.error("--held takes a count of at least 1")
        for n in range(args.runs):
            g = _run_growth(args.held)
            print(
                f"run {n + 1}: {args.held} chunks taken in at {g['per_s']:.0f}/s; "
                f"{g['full_collections']:.0f} full collections, longest "
                f"{g['longest_ms']:.0f} ms, {g['total_ms']:.0f} ms in all",
                flush=True,
            )
        return 0
    if args.floor and (args.names_only or not args.shared_feed):
        parser.error("--floor goes with --shared-feed, and its entries carry parents and tokens")
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        print("skipped: needs pyzmq and msgpack (pip install 'chunkstore[peer]')")
        return 0
    results = []
    for n in range(args.runs):
        try:
            if args.shared_feed:
                r = _run_injected(
                    args.rate, args.seconds, not args.names_only, args.place, args.floor
                )
            elif args.shared:
                r = _run_shared(args.rate, args.seconds, args.writers)
            else:
                r = _run(args.rate, args.seconds, args.step_ms)
        except RuntimeError as exc:  # a server that is not installed or did not start
            print(f"skipped: {exc}")
            return 0
        results.append(r)
        print(
            f"run {n + 1}: {r['events']:.0f} events ({r['stores_per_s']:.0f} stores/s), "
            f"{r['events_per_s']:.0f} events/s, "
            f"lag p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, lost {r['lost']:.0f}"
            + (
                f"; publisher alone {r['drained_per_s']:.0f} events/s"
                if args.shared and not args.shared_feed
                else ""
            ),
            flush=True,
        )

    def span(name: str, fmt: str) -> str:
        values = [r[name] for r in results]
        return f"{format(min(values), fmt)}-{format(max(values), fmt)}"

    what = f"step {args.step_ms:g} ms"
    if args.shared_feed:
        what = f"shared store on {args.place}, feed appended at the rate, entries " + (
            "naming chunks alone" if args.names_only else "with parents and tokens"
        )
        if args.floor:
            what += ", published by the bare floor loop"
    elif args.shared:
        what = f"shared store, {args.writers} writer processes"
    print(
        f"{args.runs} runs at {args.rate} stores/s ({what}): "
        f"{span('events_per_s', '.0f')} events/s, lag p50 {span('p50_ms', '.1f')} ms, "
        f"p99 {span('p99_ms', '.1f')} ms, lost {span('lost', '.0f')}; "
        f"median p99 {statistics.median(r['p99_ms'] for r in results):.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
