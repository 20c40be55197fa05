"""Node service benchmark: eight engine processes sharing one host cache vs one in-process cache.

A node service (a NodeServer on a unix socket, plane ``shm``, over a HostCache in
``/dev/shm``) holds a conversation of 256-token chunks; ``--clients`` processes
attach with :class:`~chunkstore.node.NodeStore` and, each for ``--seconds``:

* lookups: ``lookup_prefix`` of the conversation's 16-key chain (one round trip);
* gets: ``get_into`` of a random chunk into a private buffer (fetch: the service
  pins the slot for the client, the client copies out of its mapping, releases).

The baseline is the same work on a single in-process HostCache (one process, no
socket: ``lookup_prefix`` and ``get_into``). Reported: lookups/s and get throughput
(GB/s) summed over the clients, and the ratio to the baseline. Numbers depend on the
cores available (the clients and the service share them); nothing fails on a ratio.

    python tools/bench_node.py [--clients 8] [--seconds 2] [--chunks 16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from typing import Any

CHAIN = 16


def _chunks(count: int) -> list[Any]:
    from chunkstore.format import ChunkLayout, KVSpec
    from chunkstore.testing.factories import conversation_tokens, make_chunks

    spec = KVSpec.simple(
        "bench/node", num_layers=8, num_kv_heads=4, head_dim=64, dtype="BF16", chunk_tokens=256
    )
    layout = ChunkLayout(spec)
    return make_chunks(layout, conversation_tokens(7, count * spec.chunk_tokens))


def _work(store: Any, keys: list[Any], size: int, seconds: float) -> tuple[int, int, int]:
    """(lookups, gets, bytes) done in ``seconds`` each."""
    rng = random.Random(os.getpid())
    chain = keys[:CHAIN]
    lookups = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        store.lookup_prefix(chain)
        lookups += 1
    buffer = bytearray(size)
    gets = nbytes = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        got = store.get_into(rng.choice(keys), buffer)
        gets += 1
        nbytes += got or 0
    return lookups, gets, nbytes


def _client(socket: str, count: int, seconds: float, start: Any, out: Any) -> None:
    from chunkstore.node import NodeClient, NodeStore

    chunks = _chunks(count)
    size = len(chunks[0].data)
    store = NodeStore(NodeClient(socket, slot_size=size, client_name=f"bench-{os.getpid()}"))
    store.client.attach()
    start.wait()
    out.put(_work(store, [c.key for c in chunks], size, seconds))
    store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        import zmq  # noqa: F401
    except ImportError:
        print("skipped: the node service needs pyzmq (pip install 'chunkstore[peer]')")
        return 0
    from chunkstore.cache import HostCache
    from chunkstore.node import NodeServer

    chunks = _chunks(args.chunks)
    size = len(chunks[0].data)
    keys = [c.key for c in chunks]
    print(
        f"{args.chunks} chunks of {size / 2**20:.2f} MiB; {args.clients} client processes, "
        f"{args.seconds:g} s per phase"
    )

    local = HostCache(size, num_slots=args.chunks, pin_memory=False)
    local.put_many([(c.key, c.data) for c in chunks])
    base_lookups, _, base_bytes = _work(local, keys, size, args.seconds)
    local.close()
    base_lookup_rate = base_lookups / args.seconds
    base_gbps = base_bytes / args.seconds / 1e9

    host = HostCache(
        size, num_slots=args.chunks, shm_name=f"bench-node-{os.getpid()}", pin_memory=False
    )
    host.put_many([(c.key, c.data) for c in chunks])
    with tempfile.TemporaryDirectory() as tmp:
        socket = os.path.join(tmp, "node.sock")
        server = NodeServer(
            host, bind=f"ipc://{socket}", planes=("shm",), use_env_secret=False
        ).start()
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(target=_client, args=(socket, args.chunks, args.seconds, start, out))
            for _ in range(args.clients)
        ]
        for proc in procs:
            proc.start()
        # Every client attaches (a session each) before the start signal.
        while server.stats()["sessions"] < args.clients:
            if not all(p.is_alive() for p in procs):
                print("a client process died before attaching", file=sys.stderr)
                return 1
            time.sleep(0.05)
        start.set()
        results = [out.get(timeout=120 + 4 * args.seconds) for _ in procs]
        for proc in procs:
            proc.join()
        server.stop()
    host.close()
    lookup_rate = sum(r[0] for r in results) / args.seconds
    gbps = sum(r[2] for r in results) / args.seconds / 1e9
    print(f"in-process HostCache : {base_lookup_rate:10.0f} lookups/s  {base_gbps:7.2f} GB/s gets")
    print(
        f"node, {args.clients} clients     : {lookup_rate:10.0f} lookups/s  {gbps:7.2f} GB/s gets"
        f"  ({lookup_rate / base_lookup_rate:.2f}x, {gbps / base_gbps:.2f}x the in-process cache;"
        f" {os.cpu_count()} cores here)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
