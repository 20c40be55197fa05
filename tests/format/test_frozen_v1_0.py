"""Chunks and keys written by chunkstore 1.0 stay readable and derivable by every later release.

``tests/format/frozen_v1_0/`` was written once, by the library as it was before the format
was frozen (issue #9), and is never regenerated (spec/FORMAT.md section 2: every v1.x chunk
stays readable, keys of a major never change). If this test fails, the change broke stored
data: fix the change, not the fixture.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkstore.format import ChunkLayout, KVSpec, decode_chunk, decode_into, mac_key_from_secret
from chunkstore.hashing import chain_keys, namespace_root

FROZEN = Path(__file__).resolve().parent / "frozen_v1_0"
MANIFEST = json.loads((FROZEN / "manifest.json").read_text())


def _tokens(length: int) -> np.ndarray:
    return ((np.arange(length, dtype=np.uint64) * 2654435761) % 2**32).astype(np.uint32)


def _untag(value: dict[str, Any] | None) -> Any:
    if value is None:
        return None
    (kind, inner), *_ = value.items()
    if kind == "list":
        return [_untag(v) for v in inner]
    if kind == "int":
        return int(inner)
    if kind == "bytes":
        return bytes.fromhex(inner)
    return inner  # str, bool


def test_frozen_corpus_is_present() -> None:
    assert len(MANIFEST["chunks"]) >= 12
    assert len(MANIFEST["roots"]) >= 14


@pytest.mark.parametrize("case", MANIFEST["chunks"], ids=lambda c: c["file"])
def test_frozen_chunk_is_read_and_its_keys_rederived(case: dict[str, Any]) -> None:
    data = (FROZEN / case["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == case["sha256"]
    spec = KVSpec.from_dict(case["spec"])
    assert spec.canonical_json().decode("ascii") == case["canonical_json"]
    assert spec.fingerprint().hex() == case["fingerprint"]
    root = namespace_root(spec.fingerprint())
    assert root.hex() == case["namespace_root"]
    keys = chain_keys(_tokens(2 * spec.chunk_tokens), root=root, chunk_tokens=spec.chunk_tokens)
    assert [k.hex for k in keys] == case["keys"]
    secret = case["options"].get("mac_secret")
    mac_key = mac_key_from_secret(secret) if secret else None
    chunk = decode_chunk(
        data,
        mac_key=mac_key,
        expected_key=keys[1].digest,
        expected_fingerprint=spec.fingerprint(),
    )
    assert chunk.header.parent == keys[0].digest
    assert chunk.header.namespace == keys[1].namespace
    layout = ChunkLayout(spec)
    payload = ((np.arange(layout.payload_size, dtype=np.uint64) * 7 + 3) % 251).astype(np.uint8)
    if layout.dtype.itemsize == 2:
        payload[1::2] &= 0x3F
    assert bytes(chunk.payload) == payload.tobytes()
    arrays = {s.name: np.empty(s.shape, layout.dtype.numpy) for s in layout.tensors}
    decode_into(data, arrays, mac_key=mac_key, expected_key=keys[1].digest)
    assert b"".join(a.tobytes() for a in arrays.values()) == payload.tobytes()


@pytest.mark.parametrize("case", MANIFEST["roots"], ids=lambda c: c["namespace_root"][:12])
def test_frozen_namespace_roots_are_rederived(case: dict[str, Any]) -> None:
    extra = {name: _untag(value) for name, value in case["extra"].items()}
    root = namespace_root(bytes.fromhex(case["fingerprint"]), extra=extra)
    assert root.hex() == case["namespace_root"]
    assert [k.hex for k in chain_keys(_tokens(32), root=root, chunk_tokens=16)] == case["keys"]
