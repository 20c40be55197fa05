"""Regenerate spec/vectors/ (key vectors and golden chunks) from the inputs described in them.

Run only when the format changes on purpose (a new version); tests compare the
library's output byte for byte against what this wrote. Usage:
    python tools/make_vectors.py [--check]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from chunkstore.format import (
    MLA,
    ChunkLayout,
    KVSpec,
    LayerGroup,
    encode_chunk,
    key_digest,
    mac_key_from_secret,
    recompress,
)
from chunkstore.hashing import chain_keys, namespace_of, namespace_root

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
TOKEN_LENGTHS = (0, 1, 15, 16, 17, 31, 32, 48, 100)
KEY_COMMENT = (
    "Key derivation vectors. Input tokens for case length L are t[i] = (i * 2654435761) mod "
    "2**32 for i in 0..L-1 (uint32, hashed little-endian). The model fingerprint is "
    "BLAKE3-256 of the canonical JSON of the spec given in 'spec'; the namespace root is "
    "derived from it and 'extra'. 'keys' lists one BLAKE3 chain key per full chunk of "
    "chunk_tokens tokens; a partial tail has none."
)
CHUNK_COMMENT = (
    "Golden chunks. Tokens t[i] = (i * 2654435761) mod 2**32 for i in 0..chunk_tokens-1; each "
    "is the first chunk of its conversation, so parent = namespace root. Tensor contents: the "
    "payload byte at payload offset j is (j * 7 + 3) mod 251, then for 2-byte dtypes the high "
    "byte of each element is ANDed with 0x3f (finite values). Files are stored next to this "
    "JSON; 'sha256' is of the file."
)


def tokens_for(length: int) -> np.ndarray:
    return ((np.arange(length, dtype=np.uint64) * 2654435761) % 2**32).astype(np.uint32)


def payload_tensors(layout: ChunkLayout) -> dict[str, np.ndarray]:
    payload = ((np.arange(layout.payload_size, dtype=np.uint64) * 7 + 3) % 251).astype(np.uint8)
    if layout.dtype.itemsize == 2:
        payload[1::2] &= 0x3F
    return {
        slot.name: payload[slot.offset : slot.offset + slot.nbytes]
        .view(layout.dtype.numpy)
        .reshape(slot.shape)
        for slot in layout.tensors
    }


def key_cases() -> list[dict]:
    specs = [
        KVSpec.simple("vectors/tiny", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=16),
        KVSpec.simple("meta-llama/Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128),
    ]
    cases = []
    for spec in specs:
        for extra in (
            None,
            {"cache_salt": "tenant-a"},
            {"lora": "sql-adapter", "mm": ["ab12", "cd34"]},
        ):
            root = namespace_root(spec.fingerprint(), extra=extra)
            lengths = TOKEN_LENGTHS if spec.chunk_tokens == 16 else (255, 256, 600)
            for length in lengths:
                keys = chain_keys(tokens_for(length), root=root, chunk_tokens=spec.chunk_tokens)
                cases.append(
                    {
                        "spec": spec.to_dict(),
                        "fingerprint": spec.fingerprint().hex(),
                        "extra": extra,
                        "namespace_root": root.hex(),
                        "namespace": namespace_of(root),
                        "num_tokens": length,
                        "keys": [k.hex for k in keys],
                    }
                )
    return cases


def chunk_cases() -> list[tuple[dict, bytes]]:
    tiny = KVSpec.simple("vectors/tiny", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=16)
    mla = KVSpec("vectors/mla", "F8_E4M3", 16, (LayerGroup(MLA, (0, 1), 1, 8),))
    out = []
    for name, spec, options in [
        ("tiny-bf16", tiny, {}),
        ("tiny-bf16-mac", tiny, {"mac_secret": "vector secret"}),
        ("tiny-bf16-zstd", tiny, {"compression": "zstd"}),
        ("mla-fp8", mla, {}),
    ]:
        secret = options.get("mac_secret")
        mac_key = mac_key_from_secret(secret) if secret else None
        layout = ChunkLayout(spec, authenticated=mac_key is not None)
        root = namespace_root(spec.fingerprint())
        tokens = tokens_for(spec.chunk_tokens)
        data = bytes(
            encode_chunk(
                layout,
                key=key_digest(root, tokens),
                parent=root,
                namespace=namespace_of(root),
                tokens=tokens,
                tensors=payload_tensors(layout),
                mac_key=mac_key,
            )
        )
        if options.get("compression"):
            data = recompress(data, options["compression"], mac_key=mac_key)
        case = {
            "file": f"{name}.kvc",
            "spec": spec.to_dict(),
            "options": options,
            "key": key_digest(root, tokens).hex(),
            "parent": root.hex(),
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        out.append((case, data))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    keys_doc = {"_comment": KEY_COMMENT, "cases": key_cases()}
    chunks = chunk_cases()
    chunks_doc = {"_comment": CHUNK_COMMENT, "cases": [c for c, _ in chunks]}
    files = {
        VECTORS / "keys.json": (json.dumps(keys_doc, indent=1) + "\n").encode(),
        VECTORS / "chunks.json": (json.dumps(chunks_doc, indent=1) + "\n").encode(),
    }
    for case, data in chunks:
        files[VECTORS / "chunks" / case["file"]] = data
    if args.check:
        stale = [str(p) for p, data in files.items() if not p.exists() or p.read_bytes() != data]
        print("\n".join(stale) or "vectors up to date")
        return 1 if stale else 0
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path.relative_to(VECTORS.parent.parent)} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
