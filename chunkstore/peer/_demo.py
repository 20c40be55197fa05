"""The peer part of ``chunkstore demo``: a second process pulls chunks the first one serves.

This process plays the prefill instance.
It synthesises the KV chunks of a conversation into a store.
It serves the store with a :class:`~chunkstore.peer.PeerServer`.
A spawned decode process connects and looks up the conversation's prefix.
It pulls the chunks over the best data plane both sides have.
That is NIXL when installed, else inline ZeroMQ.
It verifies every byte against what it expects, and reports back.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from chunkstore.backends.base import Store

_SEED = 2026
_TOKENS = 16 * 24  # 24 chunks of the demo's 16-token chunks


@dataclass(frozen=True, slots=True)
class PeerDemoResult:
    """What the decode process saw."""

    chunks: int
    """Chunks the prefill side served."""
    prefix: int
    """Leading chunks the decode side found on the peer."""
    verified: int
    """Chunks pulled whose bytes matched exactly."""
    plane: str
    """Data plane used (``nixl`` or ``inline``)."""
    plane_reason: str
    """Why that plane (e.g. why NIXL was not used)."""
    bytes: int
    """Bytes pulled."""
    seconds: float
    """Wall time of lookup + pull + verify in the decode process."""

    @property
    def ok(self) -> bool:
        """Every chunk found and verified."""
        return self.prefix == self.chunks == self.verified


def _conversation() -> list[Any]:
    from chunkstore.format import ChunkLayout
    from chunkstore.testing.factories import conversation_tokens, make_chunks, small_spec

    layout = ChunkLayout(small_spec(chunk_tokens=16, num_layers=4, num_kv_heads=8, head_dim=64))
    return make_chunks(layout, conversation_tokens(_SEED, _TOKENS))


def _decode(conn: Connection, endpoint: str, secret: bytes | None) -> None:
    """The decode process: pull the conversation and check it."""
    from chunkstore.peer import PeerStore

    expected = _conversation()
    keys = [c.key for c in expected]
    started = time.perf_counter()
    store = PeerStore(
        [endpoint], secret=secret, use_env_secret=False, timeout_s=10, recv_arena_bytes=8 << 20
    )
    with store:
        prefix = store.lookup_prefix(keys)
        got = store.get_many(keys[:prefix])
        verified = sum(g is not None and bytes(g) == c.data for g, c in zip(got, expected))
        (client,) = store.clients()  # one peer: the prefill process
        conn.send(
            PeerDemoResult(
                chunks=len(expected),
                prefix=prefix,
                verified=verified,
                plane=client.plane or "-",
                plane_reason=client.plane_reason,
                bytes=sum(len(g) for g in got if g is not None),
                seconds=time.perf_counter() - started,
            )
        )


def run_peer_demo(
    store: Store | None = None,
    *,
    out: Callable[[str], None] = print,
    secret: bytes | None = None,
    timeout_s: float = 120.0,
) -> PeerDemoResult:
    """Serve a conversation's chunks from ``store``, and let a second process pull them.
    ``store`` defaults to a new MemoryStore.
    The second process verifies the chunks.
    A short account is printed through ``out``."""
    from chunkstore.backends._memory import MemoryStore
    from chunkstore.peer import PeerServer

    served = store if store is not None else MemoryStore()
    made = _conversation()
    served.put_many([(c.key, c.data) for c in made])
    out(
        f"peer demo: prefill process serves {len(made)} chunks "
        f"({sum(len(c.data) for c in made) / 2**20:.1f} MiB)"
    )
    with PeerServer(served, secret=secret, use_env_secret=False, staging_bytes=16 << 20) as server:
        out(f"peer demo: listening on {server.endpoint} (planes: {', '.join(server.planes)})")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_decode, args=(child, server.endpoint, secret), daemon=True)
        proc.start()
        try:
            if not parent.poll(timeout_s):
                raise TimeoutError("the decode process did not report in time")
            result: PeerDemoResult = parent.recv()
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    rate = result.bytes / result.seconds / 1e6 if result.seconds else 0.0
    why = f" ({result.plane_reason})" if result.plane_reason else ""
    out(
        f"peer demo: decode process found {result.prefix}/{result.chunks} chunks, pulled "
        f"{result.bytes / 2**20:.1f} MiB over {result.plane}{why} "
        f"in {result.seconds * 1000:.0f} ms "
        f"({rate:.0f} MB/s incl. process start-up of NIXL/ZeroMQ), "
        f"{result.verified} verified byte for byte"
    )
    return result
