"""Peer transfer benchmark: a peer fetch vs the raw transport moving the same bytes.

Two processes on this machine. The server process holds 256-token chunks of a
Llama-3-8B-shaped model (32 layers x 8 KV heads x 128, bf16: 32 MiB per chunk)
in a HostCache and serves it with a PeerServer; it also answers a bare ZeroMQ
socket that returns the same slot bytes. The client (this process) measures:

* NIXL plane: ``PeerStore.get_into`` into a NIXL-registered buffer (fetch
  request, lease, READ straight from the server's slot, checksum verified,
  lease released) vs a raw NIXL READ of the same slot into the same buffer;
* inline plane: ``PeerStore.get_into`` over ZeroMQ (fetch request, data frame,
  copy into the buffer, checksum verified) vs a raw ZeroMQ request/reply
  returning the same bytes (received without copy, not verified).

Runs are interleaved (peer, raw, peer, raw, ...) and the median per-fetch time
is reported. Smaller counts than production (``--chunks``, ``--rounds``) keep
it under a minute; ratios never fail the run.

    python tools/bench_peer.py [--chunks 6] [--rounds 5] [--small]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


def _spec(small: bool) -> Any:
    from chunkstore.format import KVSpec

    if small:
        return KVSpec.simple(
            "bench/small",
            num_layers=24,
            num_kv_heads=2,
            head_dim=64,
            dtype="BF16",
            chunk_tokens=256,
        )
    return KVSpec.simple(
        "bench/llama-3-8b-like",
        num_layers=32,
        num_kv_heads=8,
        head_dim=128,
        dtype="BF16",
        chunk_tokens=256,
    )


def _chunks(small: bool, count: int) -> list[Any]:
    from chunkstore.format import ChunkLayout
    from chunkstore.testing.factories import conversation_tokens, make_chunks

    layout = ChunkLayout(_spec(small))
    return make_chunks(layout, conversation_tokens(99, count * 256))


def _host_cache(slot: int, slots: int) -> Any:
    from chunkstore.cache import HostCache

    class ServedCache(HostCache):
        # Until HostCache reports its pool itself, hand the pool to NIXL explicitly.
        def memory_regions(self) -> list[Any]:
            native = getattr(super(), "memory_regions", None)
            return list(native()) if native else [self.pool._buf]

    return ServedCache(slot, num_slots=slots, pin_memory=False)


def server(conn: Connection, small: bool, count: int) -> None:
    import zmq

    from chunkstore.peer import PeerServer

    chunks = _chunks(small, count)
    cache = _host_cache(len(chunks[0].data), count)
    cache.put_many([(c.key, c.data) for c in chunks])
    peer = PeerServer(cache, staging_bytes=1 << 20, use_env_secret=False).start()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.ROUTER)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    conn.send((peer.endpoint, f"tcp://127.0.0.1:{raw_port}", list(peer.planes)))
    pins = [cache.acquire(c.key) for c in chunks]  # the raw path serves the same slots
    poller = zmq.Poller()
    poller.register(raw, zmq.POLLIN)
    while not conn.poll(0):
        if poller.poll(100):
            ident, index = raw.recv_multipart()
            raw.send_multipart([ident, pins[int(index)].view], copy=False)
    for pin in pins:
        cache.release(pin)
    peer.stop()


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def _row(name: str, size: int, samples: list[float]) -> dict[str, Any]:
    median = statistics.median(samples)
    return {"path": name, "ms": median * 1000, "gbps": size / median / 1e9}


def bench_nixl(endpoint: str, chunks: list[Any], rounds: int) -> list[tuple[dict, dict]] | None:
    from chunkstore.peer import PeerStore
    from chunkstore.peer._nixlplane import address_of
    from chunkstore.peer._protocol import pack_keys

    size = len(chunks[0].data)
    store = PeerStore(
        [endpoint], plane="nixl", timeout_s=30, recv_arena_bytes=1 << 20, use_env_secret=False
    )
    try:
        dest = np.empty(size, dtype=np.uint8)
        if not store.register_memory(dest):
            return None
        keys = [c.key for c in chunks]
        assert store.lookup_prefix(keys) == len(keys)
        (client,) = store.clients()
        # The raw baseline READs the very slots the server hands out, via the same agents.
        reply, _ = client.request(
            "fetch", {"keys": pack_keys(keys), "plane": "nixl", "lease_ms": 600_000}
        )
        addresses = [item[0] for item in reply["items"]]
        endpoint_ = client._nixl.endpoint  # noqa: SLF001 - benchmark reaches for the raw agent
        remote = client._remote_agent  # noqa: SLF001
        local = address_of(dest)[0]
        peer_t: list[float] = []
        raw_t: list[float] = []
        for _ in range(rounds):
            for key, address in zip(keys, addresses):
                started = time.perf_counter()
                got = store.get_into(key, dest)
                peer_t.append(time.perf_counter() - started)
                assert got == size
                started = time.perf_counter()
                ok = endpoint_.read(remote, [(local, address, size)], time.monotonic() + 30)
                raw_t.append(time.perf_counter() - started)
                assert ok
        assert dest.tobytes() == chunks[-1].data
        # batched: every chunk in one request (one lease), vs one raw READ of the same list
        many = np.empty((len(keys), size), dtype=np.uint8)
        store.register_memory(many)
        base = address_of(many)[0]
        pairs = [(base + i * size, a, size) for i, a in enumerate(addresses)]
        batch_peer: list[float] = []
        batch_raw: list[float] = []
        for _ in range(rounds):
            started = time.perf_counter()
            got_many = store.get_many_into(keys, list(many))
            batch_peer.append(time.perf_counter() - started)
            assert got_many == [size] * len(keys)
            started = time.perf_counter()
            assert endpoint_.read(remote, pairs, time.monotonic() + 30)
            batch_raw.append(time.perf_counter() - started)
        client.request("release", {"lease": reply["lease"], "ack": True})
        n = len(keys)
        return [
            (_row("peer fetch (nixl)", size, peer_t), _row("raw NIXL READ", size, raw_t)),
            (
                _row(f"  {n} per fetch (nixl)", size * n, batch_peer),
                _row(f"  {n} per raw READ", size * n, batch_raw),
            ),
        ]
    finally:
        store.close()


def bench_inline(
    endpoint: str, raw_endpoint: str, chunks: list[Any], rounds: int
) -> tuple[dict, dict]:
    import zmq

    from chunkstore.peer import PeerStore

    size = len(chunks[0].data)
    store = PeerStore([endpoint], plane="inline", timeout_s=30, use_env_secret=False)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(raw_endpoint)
    try:
        dest = np.empty(size, dtype=np.uint8)
        keys = [c.key for c in chunks]
        assert store.lookup_prefix(keys) == len(keys)
        peer_t: list[float] = []
        raw_t: list[float] = []
        for _ in range(rounds):
            for i, key in enumerate(keys):
                started = time.perf_counter()
                got = store.get_into(key, dest)
                peer_t.append(time.perf_counter() - started)
                assert got == size
                started = time.perf_counter()
                sock.send(str(i).encode())
                frame = sock.recv(copy=False)
                raw_t.append(time.perf_counter() - started)
                assert len(frame.buffer) == size
        assert dest.tobytes() == chunks[-1].data
        return _row("peer fetch (inline)", size, peer_t), _row("raw ZMQ send/recv", size, raw_t)
    finally:
        sock.close(0)
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6, help="distinct chunks (default 6)")
    parser.add_argument("--rounds", type=int, default=5, help="passes over them (default 5)")
    parser.add_argument(
        "--small",
        action="store_true",
        help="a 3 MiB chunk (24 layers x 2 KV heads x 64) instead of 32 MiB",
    )
    args = parser.parse_args(argv)
    try:
        import zmq  # noqa: F401
    except ImportError:
        print("skipped: the peer benchmark needs pyzmq: pip install 'chunkstore[peer]'")
        return 0
    from chunkstore.peer._nixlplane import nixl_unavailable_reason

    chunks = _chunks(args.small, args.chunks)
    size = len(chunks[0].data)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=server, args=(child, args.small, args.chunks), daemon=True)
    proc.start()
    endpoint, raw_endpoint, planes = parent.recv()
    print(
        f"chunk: {size / 2**20:.1f} MiB (256 tokens, {_spec(args.small).model_id}); "
        f"{args.chunks} chunks x {args.rounds} rounds, one chunk per fetch; server planes: "
        f"{', '.join(planes)}"
    )
    rows: list[tuple[dict, dict]] = []
    try:
        reason = nixl_unavailable_reason()
        if reason is None and "nixl" in planes:
            result = bench_nixl(endpoint, chunks, args.rounds)
            if result is not None:
                rows.extend(result)
        else:
            print(f"NIXL plane skipped: {reason or 'server does not offer it'}")
        rows.append(bench_inline(endpoint, raw_endpoint, chunks, args.rounds))
    finally:
        parent.send("stop")
        proc.join(30)
    print(
        f"{'path':<24} {'GB/s':>7} {'ms/fetch':>9}   {'baseline':<18} {'GB/s':>7} "
        f"{'ms/fetch':>9}  {'ratio':>6}"
    )
    for peer, raw in rows:
        ratio = peer["gbps"] / raw["gbps"]
        print(
            f"{peer['path']:<24} {peer['gbps']:7.2f} {peer['ms']:9.2f}   {raw['path']:<18} "
            f"{raw['gbps']:7.2f} {raw['ms']:9.2f}  {ratio:5.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
