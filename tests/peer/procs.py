"""Process bodies for the multi-process peer tests (spawned, so they import cleanly).

Chunks are derived from a seed, so a "decode" process regenerates the exact
bytes a "prefill" process published and compares what it pulled.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

from chunkstore.backends._memory import MemoryStore
from chunkstore.testing.factories import MadeChunk, sample_chunks


def chunks_for(seed: int, count: int) -> list[MadeChunk]:
    """The conversation a process with this seed computes."""
    return sample_chunks(count, seed=seed)


def make_store(kind: str, capacity_chunks: int = 64) -> Any:
    """``memory`` or ``host`` (a HostCache whose pool is registered for zero-copy serving)."""
    if kind == "memory":
        return MemoryStore()
    from tests.peer.doubles import RegisteredHostCache

    slot = len(chunks_for(0, 1)[0].data)
    return RegisteredHostCache(slot, num_slots=capacity_chunks, pin_memory=False)


def prefill_server(
    conn: Connection,
    seed: int,
    count: int,
    store_kind: str,
    config: dict[str, Any],
    capacity_chunks: int = 64,
) -> None:
    """Compute (here: generate) chunks, publish them in a store, serve it until told to stop."""
    from chunkstore.peer import PeerServer

    store = make_store(store_kind, capacity_chunks)
    if count:
        store.put_many([(c.key, c.data) for c in chunks_for(seed, count)])
    config.setdefault("staging_bytes", 4 << 20)
    config.setdefault("use_env_secret", False)
    server = PeerServer(store, **config).start()
    conn.send(("ready", server.endpoint, os.getpid(), list(server.planes)))
    while True:
        message = conn.recv()
        if message == "stop":
            break
        if message == "keys":
            conn.send(sorted(info.key.hex for info in store.list()))
        elif message == "stats":
            conn.send(server.stats())
    stats = server.stats()
    server.stop()
    conn.send(("stopped", stats))


def decode_pull(
    conn: Connection,
    endpoints: list[str],
    seed: int,
    count: int,
    plane: str,
    config: dict[str, Any],
) -> None:
    """Pull a conversation's chunks from peers, verify them byte for byte, report."""
    from chunkstore.peer import PeerStore

    expected = chunks_for(seed, count)
    keys = [c.key for c in expected]
    config.setdefault("use_env_secret", False)
    with PeerStore(
        endpoints, plane=plane, timeout_s=10, recv_arena_bytes=4 << 20, **config
    ) as store:
        prefix = store.lookup_prefix(keys)
        got = store.get_many(keys[:prefix])
        matches = sum(g is not None and bytes(g) == c.data for g, c in zip(got, expected))
        conn.send(
            {
                "prefix": prefix,
                "matches": matches,
                "planes": store.dataplanes(),
                "corrupt": store.corrupt_detected,
            }
        )


def offload_push(
    conn: Connection,
    endpoints: list[str],
    seed: int,
    count: int,
    plane: str,
    config: dict[str, Any],
) -> None:
    """A busy instance pushes its chunks to the peer with the most free capacity."""
    from chunkstore.peer import PeerStore

    made = chunks_for(seed, count)
    config.setdefault("use_env_secret", False)
    with PeerStore(
        endpoints, plane=plane, timeout_s=10, recv_arena_bytes=4 << 20, stats_ttl_s=0, **config
    ) as store:
        target = store.push_targets()[0].endpoint
        stored = store.put_many([(c.key, c.data) for c in made])
        conn.send({"target": target, "stored": stored, "planes": store.dataplanes()})


def stalled_reader(conn: Connection, endpoint: str, keys: bytes, fetches: int) -> None:
    """Say hello, send ``fetches`` inline fetches of ``keys``, then never read a reply again
    while staying connected (a stopped process, a network partition without a reset)."""
    import msgpack
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)

    def send(body: dict[str, Any]) -> None:
        sock.send_multipart([msgpack.packb({"v": 1, **body}, use_bin_type=True), b""])

    hello = {"versions": [1], "client": "stalled", "planes": ["inline"]}
    send(
        {
            "id": 1,
            "op": "hello",
            **hello,
            "fingerprint": None,
            "chunk_tokens": None,
            "nixl_md": None,
        }
    )
    assert sock.poll(10_000)
    session = msgpack.unpackb(sock.recv_multipart()[0])["s"]
    for i in range(fetches):
        fetch = {"s": session, "keys": keys, "plane": "inline", "lease_ms": 0}
        send({"id": 2 + i, "op": "fetch", **fetch})
    conn.send("sent")
    conn.recv()  # until the test is done; then the process is killed
