"""A second engine's adapter needs the tiering layer and the host cache, nothing from vllm/.

The adapter here does what an engine's connector does: it derives a prompt's chunk keys,
asks how many are held, writes the KV of new chunks into the slots it is given and seals
them, and later loads them through host memory. A second engine on the same directory
finds them on disk and prefetches them into its own host memory.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chunkstore.backends import open_store
from chunkstore.format import ChunkLayout, decode_chunk
from chunkstore.hashing import ChunkKey, chain_keys, namespace_root
from chunkstore.testing.factories import conversation_tokens, small_spec
from chunkstore.tiering import EngineCache, ProcessCache

LAYOUT = ChunkLayout(small_spec())
CHUNK = LAYOUT.spec.chunk_tokens


@dataclass(frozen=True)
class Save:
    """The adapter's save record: what sealing needs (the ChunkIdentity protocol)."""

    key: ChunkKey
    parent: bytes
    tokens: tuple[int, ...]


class TinyEngine:
    """An engine adapter written against chunkstore.tiering only: its "device" KV is one
    payload per chunk position, made from the tokens so any mix-up shows."""

    def __init__(self, cache: ProcessCache) -> None:
        self.cache = cache
        self.worker: EngineCache = cache  # the worker half uses the protocol alone
        self.root = namespace_root(LAYOUT.fingerprint)

    def keys(self, tokens: np.ndarray) -> list[ChunkKey]:
        return chain_keys(tokens, root=self.root, chunk_tokens=CHUNK)

    def kv(self, tokens: np.ndarray, index: int) -> bytes:
        seed = int(tokens[index * CHUNK]) * 7919 + index
        return np.random.default_rng(seed).bytes(LAYOUT.payload_size)

    def save(self, tokens: np.ndarray) -> int:
        """Save every full chunk not held yet; how many were written."""
        keys = self.keys(tokens)
        held = self.cache.tier_prefix(keys)
        written = 0
        for i in range(held, len(keys)):
            parent = self.root if i == 0 else keys[i - 1].digest
            save = Save(keys[i], parent, tuple(int(t) for t in tokens[i * CHUNK : (i + 1) * CHUNK]))
            slot = self.worker.save_slot(save)
            assert slot is not None
            slot.view[LAYOUT.data_offset : LAYOUT.total_size] = self.kv(tokens, i)
            self.worker.save_done(save, slot)
            written += 1
        self.worker.flush()
        return written

    def load(self, tokens: np.ndarray) -> list[bytes]:
        """Bring the held prefix into host memory, then copy each chunk's KV out of it."""
        keys = self.keys(tokens)
        fetched = self.cache.submit_prefetch(keys).result(timeout=30).fetched
        loaded = []
        for key in keys[:fetched]:
            with self.worker.read_host(key) as data:
                assert data is not None
                chunk = decode_chunk(data, expected_key=key.digest)
                loaded.append(bytes(chunk.payload))
        return loaded


def _engine(tmp_path: Path) -> TinyEngine:
    store = open_store(str(tmp_path / "kv"), create=True)
    return TinyEngine(ProcessCache(host_bytes=1 << 20, layout=LAYOUT, stores=[store]))


def test_save_lookup_and_load_through_the_tiering_layer(tmp_path: Path) -> None:
    tokens = conversation_tokens(3, 4 * CHUNK + 5)
    first = _engine(tmp_path)
    try:
        assert first.save(tokens) == 4
        assert first.save(tokens) == 0  # held now: nothing written twice
        assert first.cache.host_run(first.keys(tokens)) == 4
        assert first.load(tokens) == [first.kv(tokens, i) for i in range(4)]
    finally:
        first.cache.close()
    # A second engine (a new process would do the same) finds the chunks on disk only.
    second = _engine(tmp_path)
    try:
        keys = second.keys(tokens)
        assert second.cache.host_run(keys) == 0
        assert second.cache.tier_prefix(keys) == 4
        assert second.load(tokens) == [second.kv(tokens, i) for i in range(4)]
        assert second.cache.host_run(keys) == 4  # prefetched into its own host memory
        longer = np.concatenate([tokens, conversation_tokens(4, 2 * CHUNK)])
        assert second.save(longer) == 2  # only the new turn's chunks
    finally:
        second.cache.close()


def test_the_adapter_loads_no_engine_module() -> None:
    code = (
        "import sys; import chunkstore.tiering as t; import chunkstore.cache;"
        "t.ProcessCache; t.RankCache; t.EngineCache; t.TieredStore; t.TierList;"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith(('vllm.',"
        " 'chunkstore.vllm', 'torch')));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
