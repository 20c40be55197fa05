"""Deterministic chunk factories for tests, benchmarks and demos.

Everything is derived from a seed, so two processes asked for the same
conversation produce byte-identical chunks (what multi-process tests compare).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chunkstore.format import ChunkLayout, KVSpec, encode_chunk
from chunkstore.hashing import ChunkKey, chain_keys, namespace_root, parent_of


def small_spec(
    chunk_tokens: int = 16,
    *,
    num_layers: int = 2,
    num_kv_heads: int = 4,
    head_dim: int = 8,
    dtype: str = "BF16",
    model_id: str = "test/tiny",
) -> KVSpec:
    """A tiny full-attention model description (a few KiB per chunk)."""
    return KVSpec.simple(
        model_id,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
    )


def conversation_tokens(seed: int, length: int, vocab: int = 32000) -> np.ndarray:
    """A deterministic token sequence."""
    return np.random.default_rng(seed).integers(0, vocab, size=length, dtype=np.uint32)


def growing_conversation(
    system: np.ndarray, turn_seeds: Sequence[int], turn_tokens: int
) -> list[np.ndarray]:
    """One chat's prompts: each turn appends ``turn_tokens`` deterministic tokens (seeded by
    that turn's seed) to the previous prompt, starting from the shared ``system`` prompt."""
    prompts: list[np.ndarray] = []
    prompt = system
    for seed in turn_seeds:
        prompt = np.concatenate([prompt, conversation_tokens(seed, turn_tokens)])
        prompts.append(prompt)
    return prompts


def kv_tensors(layout: ChunkLayout, tokens: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """Deterministic tensor contents for one chunk: a function of the tokens it covers."""
    seed = int(np.asarray(tokens, dtype=np.uint64).sum() % (2**32))
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for slot in layout.tensors:
        raw = rng.integers(0, 256, size=slot.nbytes, dtype=np.uint8)
        if layout.dtype.itemsize == 2:
            # keep values finite: clear the top exponent bit of every bf16/fp16 element
            raw[1::2] &= 0x3F
        out[slot.name] = raw.view(layout.dtype.numpy).reshape(slot.shape)
    return out


def prompt_chunk(
    layout: ChunkLayout, prompt: np.ndarray, keys: Sequence[ChunkKey], index: int, root: bytes
) -> bytes:
    """Chunk ``index`` of ``prompt`` under ``keys``, its KV from :func:`kv_tensors`."""
    step = layout.spec.chunk_tokens
    tokens = prompt[index * step : (index + 1) * step]
    data: bytes = encode_chunk(
        layout,
        key=keys[index].digest,
        parent=parent_of(keys, index, root),
        namespace=keys[index].namespace,
        tokens=tokens,
        tensors=kv_tensors(layout, tokens),
    )
    return data


@dataclass(frozen=True, slots=True)
class MadeChunk:
    """One encoded chunk with the inputs that made it."""

    key: ChunkKey
    """Its key."""
    parent: bytes
    """Parent digest (the root for the first chunk)."""
    tokens: np.ndarray
    """Tokens covered."""
    data: bytes
    """The chunk file's bytes."""


def make_chunks(
    layout: ChunkLayout,
    tokens: Sequence[int] | np.ndarray,
    *,
    extra: dict[str, str] | None = None,
    mac_key: bytes | None = None,
) -> list[MadeChunk]:
    """Encode every full chunk of a token sequence, chained under the layout's namespace."""
    token_array = np.asarray(tokens, dtype=np.uint32)
    root = namespace_root(layout.fingerprint, extra=extra)
    keys = chain_keys(token_array, root=root, chunk_tokens=layout.spec.chunk_tokens)
    made: list[MadeChunk] = []
    parent = root
    step = layout.spec.chunk_tokens
    for i, key in enumerate(keys):
        chunk_tokens = token_array[i * step : (i + 1) * step]
        data = encode_chunk(
            layout,
            key=key.digest,
            parent=parent,
            namespace=key.namespace,
            tokens=chunk_tokens,
            tensors=kv_tensors(layout, chunk_tokens),
            mac_key=mac_key,
        )
        made.append(MadeChunk(key, parent, chunk_tokens, bytes(data)))
        parent = key.digest
    return made


def sample_chunks(
    count: int, *, seed: int = 0, layout: ChunkLayout | None = None
) -> list[MadeChunk]:
    """``count`` chunks of one conversation (so their keys chain)."""
    layout = layout or ChunkLayout(small_spec())
    tokens = conversation_tokens(seed, count * layout.spec.chunk_tokens)
    return make_chunks(layout, tokens)
