"""``chunkstore demo``: a multi-turn workload on a real store, narrated.

Two conversations share a system prompt. Each turn looks its prompt's chunk
chain up in the store, "computes" KV only for the chunks that are missing
(deterministic synthetic tensors stand in for a model's prefill), writes them,
and finally reloads the shared prefix and checks it byte for byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from chunkstore.backends._models import record_model
from chunkstore.backends.base import Store
from chunkstore.format import ChunkLayout, KVSpec, decode_into
from chunkstore.hashing import chain_keys, namespace_of, namespace_root
from chunkstore.testing.factories import (
    conversation_tokens,
    growing_conversation,
    kv_tensors,
    prompt_chunk,
)

Printer = Callable[[str], None]

DEMO_SPEC = KVSpec.simple(
    "chunkstore/demo-8l", num_layers=8, num_kv_heads=4, head_dim=64, dtype="BF16", chunk_tokens=64
)
"""The demo's model: 8 layers, 4 KV heads of 64, bf16, 64-token chunks (512 KiB each)."""


@dataclass
class DemoReport:
    """What the demo did, for the summary and for tests."""

    chunks_written: int = 0
    chunks_reused: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    turns: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(conversation, prompt tokens, chunks hit, chunks written) per turn."""
    verified_chunks: int = 0
    keys: list[str] = field(default_factory=list)
    """Hex keys of the shared prefix's chunks."""


def conversations(chunk_tokens: int) -> dict[str, list[np.ndarray]]:
    """Two chats sharing a 4-chunk system prompt; each turn's prompt extends the previous one."""
    system = conversation_tokens(1, 4 * chunk_tokens)
    return {
        name: growing_conversation(
            system, [seed * 10 + turn for turn in range(3)], 2 * chunk_tokens + 17
        )
        for name, seed in (("chat-A", 2), ("chat-B", 3))
    }


def run_store_demo(store: Store, out: Printer = print) -> DemoReport:
    """Replay the two conversations against ``store`` and verify the shared prefix."""
    layout = ChunkLayout(DEMO_SPEC)
    root = namespace_root(layout.fingerprint)
    step = DEMO_SPEC.chunk_tokens
    report = DemoReport()
    record_model(store, DEMO_SPEC)  # so `chunkstore inspect` names the model
    out(
        f"model {DEMO_SPEC.model_id}: {DEMO_SPEC.num_layers} layers, chunk = {step} tokens "
        f"= {layout.total_size / 2**10:.0f} KiB; namespace {namespace_of(root)}"
    )
    chats = conversations(step)
    for name, turns in chats.items():
        for number, prompt in enumerate(turns, 1):
            keys = chain_keys(prompt, root=root, chunk_tokens=step)
            started = time.perf_counter()
            hit = store.lookup_prefix(keys)
            written = 0
            for i in range(hit, len(keys)):
                data = prompt_chunk(layout, prompt, keys, i, root)
                if store.put_if_absent(keys[i], data):
                    written += 1
                    report.bytes_written += len(data)
            elapsed = (time.perf_counter() - started) * 1e3
            report.chunks_reused += hit
            report.chunks_written += written
            report.turns.append((name, len(prompt), hit, written))
            out(
                f"  {name} turn {number}: {len(prompt):5d} prompt tokens, {len(keys)} full chunks: "
                f"{hit} reused from the store, {written} computed and written ({elapsed:.1f} ms)"
            )
    shared = chats["chat-A"][0][: 4 * step]
    keys = chain_keys(shared, root=root, chunk_tokens=step)
    started = time.perf_counter()
    for i, key in enumerate(keys):
        stored = store.get(key)
        if stored is None:
            raise RuntimeError(f"shared prefix chunk {key.hex} vanished from the store")
        tokens = shared[i * step : (i + 1) * step]
        expected = kv_tensors(layout, tokens)
        loaded = {name: np.empty_like(t) for name, t in expected.items()}
        decode_into(
            stored, loaded, expected_key=key.digest, expected_fingerprint=layout.fingerprint
        )
        if any(loaded[n].tobytes() != expected[n].tobytes() for n in expected):
            raise RuntimeError(f"chunk {key.hex} reloaded with different bytes")
        report.verified_chunks += 1
        report.bytes_read += len(stored)
    elapsed = (time.perf_counter() - started) * 1e3
    out(
        f"reloaded the shared {len(shared)}-token system prompt: {len(keys)} chunks, "
        f"{report.bytes_read / 2**20:.1f} MiB, verified byte for byte ({elapsed:.1f} ms)"
    )
    report.keys = [k.hex for k in keys]
    out(f"shared prefix keys: {', '.join(h[:16] + '…' for h in report.keys)}")
    out(
        f"total: {report.chunks_written} chunks written ({report.bytes_written / 2**20:.1f} MiB), "
        f"{report.chunks_reused} chunk loads avoided recompute"
    )
    return report
