"""The library reproduces spec/vectors/ byte for byte (keys and golden chunk files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import blake3
import numpy as np
import pytest

from chunkstore.format import (
    ChunkLayout,
    KVSpec,
    decode_chunk,
    encode_chunk,
    key_digest,
    mac_key_from_secret,
    recompress,
)
from chunkstore.hashing import chain_keys, namespace_of, namespace_root

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"
KEY_CASES = json.loads((VECTORS / "keys.json").read_text())["cases"]
CHUNK_CASES = json.loads((VECTORS / "chunks.json").read_text())["cases"]


def _tokens(length: int) -> np.ndarray:
    return ((np.arange(length, dtype=np.uint64) * 2654435761) % 2**32).astype(np.uint32)


def test_vector_corpus_is_present() -> None:
    assert len(KEY_CASES) >= 20
    assert len(CHUNK_CASES) >= 4
    assert any(case["keys"] for case in KEY_CASES)
    for case in CHUNK_CASES:
        assert (VECTORS / "chunks" / case["file"]).is_file()


@pytest.mark.parametrize(
    "case", KEY_CASES, ids=lambda c: f"{c['spec']['model_id']}-{c['num_tokens']}"
)
def test_key_vectors(case: dict) -> None:
    spec = KVSpec.from_dict(case["spec"])
    assert spec.fingerprint().hex() == case["fingerprint"]
    root = namespace_root(spec.fingerprint(), extra=case["extra"])
    assert root.hex() == case["namespace_root"]
    assert namespace_of(root) == case["namespace"]
    keys = chain_keys(_tokens(case["num_tokens"]), root=root, chunk_tokens=spec.chunk_tokens)
    assert [k.hex for k in keys] == case["keys"]
    assert all(k.namespace == case["namespace"] for k in keys)


@pytest.mark.parametrize("case", KEY_CASES[:12], ids=lambda c: f"independent-{c['num_tokens']}")
def test_key_vectors_follow_the_spec_formula(case: dict) -> None:
    """Recompute the chain with nothing but BLAKE3, as spec/FORMAT.md states it."""
    spec_json = json.dumps(case["spec"], sort_keys=True, separators=(",", ":")).encode()
    assert blake3.blake3(spec_json).hexdigest() == case["fingerprint"]
    if case["extra"] is None:
        root = blake3.blake3(
            bytes.fromhex(case["fingerprint"]),
            derive_key_context="chunkstore 2026-11 namespace root v1",
        ).hexdigest()
        assert root == case["namespace_root"]
    parent = bytes.fromhex(case["namespace_root"])
    tokens = _tokens(case["num_tokens"]).astype("<u4").tobytes()
    step = case["spec"]["chunk_tokens"] * 4
    expected = []
    for i in range(len(tokens) // step):
        parent = blake3.blake3(parent + tokens[i * step : (i + 1) * step]).digest()
        expected.append(parent.hex())
    assert expected == case["keys"]


def _payload(layout: ChunkLayout) -> dict[str, np.ndarray]:
    payload = ((np.arange(layout.payload_size, dtype=np.uint64) * 7 + 3) % 251).astype(np.uint8)
    if layout.dtype.itemsize == 2:
        payload[1::2] &= 0x3F
    return {
        s.name: payload[s.offset : s.offset + s.nbytes].view(layout.dtype.numpy).reshape(s.shape)
        for s in layout.tensors
    }


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: c["file"])
def test_golden_chunks_exact_bytes(case: dict) -> None:
    golden = (VECTORS / "chunks" / case["file"]).read_bytes()
    assert hashlib.sha256(golden).hexdigest() == case["sha256"]
    spec = KVSpec.from_dict(case["spec"])
    secret = case["options"].get("mac_secret")
    mac_key = mac_key_from_secret(secret) if secret else None
    layout = ChunkLayout(spec, authenticated=mac_key is not None)
    root = namespace_root(spec.fingerprint())
    tokens = _tokens(spec.chunk_tokens)
    assert key_digest(root, tokens).hex() == case["key"]
    data = bytes(
        encode_chunk(
            layout,
            key=key_digest(root, tokens),
            parent=root,
            namespace=namespace_of(root),
            tokens=tokens,
            tensors=_payload(layout),
            mac_key=mac_key,
        )
    )
    if case["options"].get("compression"):
        # Compressed bytes depend on the zstd library version; the payload they decode to does not.
        assert bytes(decode_chunk(golden).payload) == bytes(decode_chunk(data).payload)
        data = recompress(data, case["options"]["compression"], mac_key=mac_key)
        assert decode_chunk(data).header.tokens == decode_chunk(golden).header.tokens
    else:
        assert data == golden
    chunk = decode_chunk(golden, mac_key=mac_key)
    assert chunk.header.key.hex() == case["key"]
    assert chunk.header.parent.hex() == case["parent"]
