"""The tiered part of ``chunkstore demo``: a host cache smaller than the working set.

Four conversations take turns. Every turn extends its conversation's prompt.
It looks up the chunk chain across tiers. It loads what is there, from host
memory first and then from the store. Store hits are promoted into host
memory. The turn computes and writes the rest. Host memory holds fewer chunks
than the conversations need. So later turns find their older chunks only in
the store. The output shows hits per tier and promotions, turn by turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from chunkstore.backends._models import record_model
from chunkstore.backends._registry import open_store
from chunkstore.cache._host import HostCache
from chunkstore.cache.policy import DEFAULT_POLICY
from chunkstore.format import ChunkLayout, KVSpec
from chunkstore.hashing import chain_keys, namespace_root
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import (
    conversation_tokens,
    growing_conversation,
    prompt_chunk,
)
from chunkstore.tiering._tiered import TieredStore

Printer = Callable[[str], None]

TIERED_DEMO_SPEC = KVSpec.simple(
    "chunkstore/demo-tiered",
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    dtype="BF16",
    chunk_tokens=32,
)
"""A small model: 4 layers, 2 KV heads of 64 and 32-token chunks."""


@dataclass
class TieredDemoReport:
    """Counts of one run, for the summary and for tests."""

    host_hits: int = 0
    """Chunks loaded from host memory."""
    store_hits: int = 0
    """Chunks loaded from the store and promoted."""
    computed: int = 0
    """Chunks computed and written."""
    promotions: int = 0
    """Chunks copied from the store into host memory."""
    evictions: int = 0
    """Chunks the host policy evicted."""
    writes_dropped: int = 0
    """Write-backs dropped."""
    host_slots: int = 0
    """Host capacity in chunks."""
    working_set: int = 0
    """Distinct chunks over all conversations."""
    turns: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    """Per turn: conversation, turn, host hits, store hits and chunks computed."""


def _conversations(step: int, count: int, turns: int) -> list[tuple[str, list[np.ndarray]]]:
    system = conversation_tokens(100, 3 * step)  # a shared system prompt of 3 chunks
    return [
        (
            f"chat-{chr(ord('A') + c)}",
            growing_conversation(system, [1000 + 10 * c + t for t in range(turns)], 2 * step + 5),
        )
        for c in range(count)
    ]


def run_tiered_demo(
    store_url: str,
    out: Printer = print,
    *,
    host_chunks: int = 12,
    conversations: int = 4,
    turns: int = 4,
    policy: str = DEFAULT_POLICY,
) -> TieredDemoReport:
    """Run the workload: ``host_chunks`` of host memory in front of the store at ``store_url``."""
    layout = ChunkLayout(TIERED_DEMO_SPEC)
    step = TIERED_DEMO_SPEC.chunk_tokens
    root = namespace_root(layout.fingerprint, extra={"demo": "tiered"})
    options: dict[str, Any] = {} if store_url.startswith("memory://") else {"create": True}
    backing = open_store(store_url, **options)
    record_model(backing, TIERED_DEMO_SPEC)  # so `chunkstore inspect` names the model
    host = HostCache(layout, num_slots=host_chunks, policy=policy)
    store = TieredStore(
        host, [backing], metrics=ChunkstoreMetrics(CollectorRegistry()), tier_timeout=None
    )
    report = TieredDemoReport(host_slots=host_chunks)
    chats = _conversations(step, conversations, turns)
    seen: set[bytes] = set()
    out(
        f"tiered demo: {host_chunks} chunks of host memory ({policy} policy, "
        f"{host_chunks * layout.total_size / 2**20:.1f} MiB) in front of {store_url}"
    )
    out(f"{'turn':<12} {'prompt':>6} {'host':>5} {'store':>5} {'computed':>8}")
    buffer = bytearray(layout.total_size)
    try:
        for turn in range(turns):
            for name, prompts in chats:
                prompt = prompts[turn]
                keys = chain_keys(prompt, root=root, chunk_tokens=step)
                seen.update(k.digest for k in keys)
                present = store.lookup_prefix(keys)
                before = store.stats()
                for key in keys[:present]:
                    if store.get_into(key, buffer) is None:
                        present = keys.index(key)
                        break
                after = store.stats()
                host_hits = after.host.hits - before.host.hits
                store_hits = after.tiers[0].hits - before.tiers[0].hits
                for i in range(present, len(keys)):
                    data = prompt_chunk(layout, prompt, keys, i, root)
                    store.put(keys[i], data)
                computed = len(keys) - present
                report.host_hits += host_hits
                report.store_hits += store_hits
                report.computed += computed
                report.turns.append((name, turn + 1, host_hits, store_hits, computed))
                out(
                    f"{name + ' #' + str(turn + 1):<12} {len(prompt):>6} {host_hits:>5} "
                    f"{store_hits:>5} {computed:>8}"
                )
                store.flush()
        stats = store.stats()
        report.promotions = stats.tiers[0].promotions
        report.evictions = stats.host.evictions
        report.writes_dropped = stats.writes_dropped
        report.working_set = len(seen)
        total = report.host_hits + report.store_hits + report.computed
        out(f"working set {report.working_set} chunks, host memory {host_chunks} chunks")
        out(f"chunks loaded from host memory: {report.host_hits} of {total}")
        out(
            f"chunks loaded from {backing.name} (promoted to host): {report.store_hits} "
            f"(promotions {report.promotions}, host evictions {report.evictions})"
        )
        out(
            f"chunks computed and written: {report.computed} "
            f"(write-backs dropped: {report.writes_dropped})"
        )
    finally:
        store.close()
    return report
