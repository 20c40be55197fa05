"""Regenerate spec/vectors/ (every test vector of spec/FORMAT.md) from the inputs described in them.

Run only when the vectors change on purpose (a new case, a new version); tests compare
the library's output and verdicts against what this wrote. Usage:
    python tools/make_vectors.py [--check]

Files written:
    keys.json      fingerprints, namespace roots and chain keys (spec section 5)
    extra.json     encode_extra bytes per value type, and inputs that must be refused (5.2)
    chunks.json    golden chunks (chunks/*.kvc) a writer must reproduce byte for byte (3, 4)
    reader.json    chunks (reader/*.kvc) with the verdict a reader must reach: accepted,
                   unsupported or corrupt, naming the error class (3.1, 4, 2)
    tp.json        TP read and write byte ranges per rank (3.2)

Reader vectors are built from a golden chunk by editing its header text and then
sealing it again with this file's own XXH3/BLAKE3 code (not the library's), so each
holds exactly one defect and a correct checksum (unless the checksum is the defect).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import xxhash
import zstandard

from chunkstore.errors import ConfigError
from chunkstore.format import (
    ATTENTION,
    MLA,
    SLIDING_WINDOW,
    STATE,
    ChunkLayout,
    KVSpec,
    LayerGroup,
    encode_chunk,
    key_digest,
    mac_key_from_secret,
    recompress,
)
from chunkstore.hashing import chain_keys, encode_extra, namespace_of, namespace_root

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"
TOKEN_LENGTHS = (0, 1, 15, 16, 17, 31, 32, 48, 100)
ALIGNMENT = 4096
MAC_SECRET = "vector secret"
UTF8_SECRET = "clé ü 秘密"
"""A secret outside ASCII: its MAC key is derived from the UTF-8 bytes of the text."""
TOKENS_RULE = "t[i] = (i * 2654435761) mod 2**32 (uint32, little-endian when hashed or stored)"
KEY_COMMENT = (
    f"Key derivation vectors (spec section 5). Input tokens for case length L are {TOKENS_RULE} "
    "for i in 0..L-1. 'canonical_json' is the exact text whose BLAKE3-256 is 'fingerprint' "
    "(5.1); the namespace root is derived from it and 'extra' (plain JSON: strings and lists "
    "of strings; typed values are in extra.json). 'keys' lists one chain key per full chunk "
    "of chunk_tokens tokens; a partial tail has none. 'refused' lists KVSpecs a reader or "
    "writer must refuse (ConfigError here), each with the rule of section 5.1 it breaks."
)
EXTRA_COMMENT = (
    "encode_extra vectors (spec section 5.2). Values are tagged by type: {'str': text}, "
    "{'int': decimal text}, {'bool': true|false}, {'bytes': hex}, {'list': [tagged...]}, "
    "null (dropped). 'encoded' is hex(encode_extra(extra)); 'namespace_root' is derived "
    "from 'fingerprint' (the vectors/tiny spec) and it. 'refused' cases must be refused "
    "(ConfigError here); tags there also include {'float': text}, {'map': {...}}, "
    "{'int_name': n} (a non-string name) and {'surrogate': hex of UTF-16 code unit}."
)
CHUNK_COMMENT = (
    f"Golden chunks (spec sections 3 and 4). Tokens {TOKENS_RULE} for i in 0..chunk_tokens-1; "
    "each is the first chunk of its conversation, so parent = namespace root (no extra keys). "
    "Tensor contents: the payload byte at payload offset j is (j * 7 + 3) mod 251, then for "
    "2-byte dtypes the high byte of each element is ANDed with 0x3f (finite values). 'mac_secret' "
    "is the secret of section 4.2. Files are stored next to this JSON; 'sha256' is of the file. "
    "zstd bytes depend on the compressor; writers must reproduce the uncompressed ones exactly."
)
READER_COMMENT = (
    "Reader vectors (spec sections 2, 3, 4): decode each reader/<file> with the options given "
    "('mac_secret': the reader holds that secret, as the UTF-8 bytes of the text; "
    "'expected_key' / 'expected_fingerprint' / 'expected_namespace': the reader asked for "
    "that key / model / namespace) and verify the checksum. 'verdict' is what a reader must "
    "conclude (spec section 3.4): 'ok' (error null), 'unsupported' (a plain miss, never "
    "quarantined or deleted: written by a newer version), 'refused' (intact but not for this "
    "reader: a miss that leaves the stored copy alone) or 'corrupt' (a miss; quarantined); "
    "'error' names the error class a reader must raise. Each file has exactly one defect "
    "unless 'defect' says otherwise (then the order of section 3.4 decides): it was made from "
    "the golden chunk named in 'from' by the edit described in 'defect', then sealed again "
    "(correct checksum and MAC) unless the checksum or MAC is the defect."
)
TP_COMMENT = (
    "TP byte ranges (spec section 3.3): for each spec and TP size, per rank, the [offset, "
    "length] ranges of the chunk file (offsets from the file start) that rank reads and "
    "writes, adjacent ranges merged. 'error' instead of ranks: the TP size has no split."
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


def tiny(dtype: str = "BF16") -> KVSpec:
    return KVSpec.simple(
        "vectors/tiny", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=16, dtype=dtype
    )


def hybrid() -> KVSpec:
    """Every group kind but MLA, and a non-empty KVSpec extra."""
    return KVSpec(
        "vectors/hybrid",
        "BF16",
        8,
        (
            LayerGroup(ATTENTION, (0, 2), 4, 2),
            LayerGroup(SLIDING_WINDOW, (1, 3), 2, 2, sliding_window=64),
            LayerGroup(STATE, (4,), state_shape=(3, 2)),
        ),
        extra=(("kv_cache_dtype", "fp8_e4m3"), ("revision", "abc123")),
    )


def mla() -> KVSpec:
    return KVSpec("vectors/mla", "F8_E4M3", 16, (LayerGroup(MLA, (0, 1), 1, 8),))


# --- keys.json ------------------------------------------------------------------------------


def key_cases() -> list[dict[str, Any]]:
    specs = [
        tiny(),
        KVSpec.simple("meta-llama/Llama-3.1-8B", num_layers=32, num_kv_heads=8, head_dim=128),
        KVSpec.simple("vectors/modèle-Ω", num_layers=1, num_kv_heads=1, head_dim=2, chunk_tokens=4),
        KVSpec.simple(
            "vectors/\U0001f600", num_layers=1, num_kv_heads=1, head_dim=2, chunk_tokens=4
        ),
        hybrid(),
    ]
    cases = []
    for spec in specs:
        extras: list[dict[str, Any] | None] = [None]
        if spec.model_id in ("vectors/tiny", "meta-llama/Llama-3.1-8B"):
            extras += [
                {"cache_salt": "tenant-a"},
                {"lora": "sql-adapter", "mm": ["ab12", "cd34"]},
                {"mm": [f"h{i}" for i in range(12)]},
            ]
        for extra in extras:
            root = namespace_root(spec.fingerprint(), extra=extra)
            if spec.chunk_tokens == 16:
                lengths: tuple[int, ...] = TOKEN_LENGTHS if extra is None else (16, 32)
            else:
                lengths = (spec.chunk_tokens * 2, spec.chunk_tokens * 2 + 1)
            if spec.chunk_tokens == 256:
                lengths = (255, 256, 600)
            for length in lengths:
                keys = chain_keys(tokens_for(length), root=root, chunk_tokens=spec.chunk_tokens)
                cases.append(
                    {
                        "spec": spec.to_dict(),
                        "canonical_json": spec.canonical_json().decode("ascii"),
                        "fingerprint": spec.fingerprint().hex(),
                        "extra": extra,
                        "namespace_root": root.hex(),
                        "namespace": namespace_of(root),
                        "num_tokens": length,
                        "keys": [k.hex for k in keys],
                    }
                )
    return cases


# --- extra.json -----------------------------------------------------------------------------


def refused_spec_cases() -> list[dict[str, Any]]:
    """KVSpecs section 5.1 refuses: one rule broken each, the rest as vectors/tiny."""

    def spec(*, groups: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
        base: dict[str, Any] = {
            "model_id": "vectors/tiny",
            "dtype": "BF16",
            "chunk_tokens": 16,
            "groups": groups
            or [{"kind": "attention", "layers": [0, 1], "num_kv_heads": 2, "head_dim": 4}],
            "extra": [],
        }
        base.update(fields)
        return base

    def group(**fields: Any) -> list[dict[str, Any]]:
        attention = {"kind": "attention", "layers": [0], "num_kv_heads": 2, "head_dim": 4}
        return [attention, {"layers": [1], **fields}]

    return [
        {"why": "chunk_tokens 0", "spec": spec(chunk_tokens=0)},
        {"why": "chunk_tokens a string", "spec": spec(chunk_tokens="16")},
        {"why": "chunk_tokens 2^63", "spec": spec(chunk_tokens=2**63)},
        {
            "why": "head_dim a fraction",
            "spec": spec(groups=group(kind="attention", num_kv_heads=2, head_dim=4.5)),
        },
        {
            "why": "num_kv_heads negative",
            "spec": spec(groups=group(kind="attention", num_kv_heads=-2, head_dim=4)),
        },
        {
            "why": "head_dim 2^63 (at most 2^63 - 1)",
            "spec": spec(groups=group(kind="attention", num_kv_heads=2, head_dim=2**63)),
        },
        {
            "why": "a negative layer",
            "spec": spec(
                groups=[{"kind": "attention", "layers": [-1], "num_kv_heads": 2, "head_dim": 4}]
            ),
        },
        {
            "why": "layer 0 twice in one group",
            "spec": spec(
                groups=[{"kind": "attention", "layers": [0, 0], "num_kv_heads": 2, "head_dim": 4}]
            ),
        },
        {"why": "an unknown group kind", "spec": spec(groups=group(kind="conv", head_dim=4))},
        {"why": "an unknown dtype", "spec": spec(dtype="F8_E8M0")},
        {
            "why": "layer 0 in two groups",
            "spec": spec(groups=group(kind="attention", layers=[0], num_kv_heads=2, head_dim=4)),
        },
        {
            "why": "a state group with head_dim 4 (unused: must be 0)",
            "spec": spec(groups=group(kind="state", num_kv_heads=1, head_dim=4, state_shape=[8])),
        },
        {
            "why": "a state group with num_kv_heads 0 (unused: must be 1)",
            "spec": spec(groups=group(kind="state", num_kv_heads=0, head_dim=0, state_shape=[8])),
        },
        {
            "why": "an mla group with num_kv_heads 2 (unsplit: must be 1)",
            "spec": spec(groups=group(kind="mla", num_kv_heads=2, head_dim=8)),
        },
        {
            "why": "an attention group with a state_shape (unused: must be [])",
            "spec": spec(
                groups=group(kind="attention", num_kv_heads=2, head_dim=4, state_shape=[8])
            ),
        },
        {
            "why": "an attention group with a sliding_window (only sliding_window groups have one)",
            "spec": spec(
                groups=group(kind="attention", num_kv_heads=2, head_dim=4, sliding_window=64)
            ),
        },
        {
            "why": "a state group with a non-positive state_shape entry",
            "spec": spec(groups=group(kind="state", state_shape=[8, 0])),
        },
        {"why": "extra names twice", "spec": spec(extra=[["revision", "a"], ["revision", "b"]])},
        {"why": "an extra value that is not a string", "spec": spec(extra=[["revision", 7]])},
        {"why": "an extra entry that is not a pair", "spec": spec(extra=[["revision"]])},
    ]


def tagged(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": str(value)}
    if isinstance(value, str):
        return {"str": value}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list):
        return {"list": [tagged(v) for v in value]}
    raise TypeError(value)


EXTRA_ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("none", {}),
    ("dropped-none", {"lora": None}),
    ("str", {"cache_salt": "tenant-a"}),
    ("str-bmp", {"cache_salt": "Zürich-Ω"}),
    ("str-non-bmp", {"cache_salt": "\U0001f642"}),
    ("name-non-ascii", {"ключ": "v", "a": "w"}),
    ("name-order-by-code-point", {"\U0001f642": "x", "\uffff": "y", "z": "w"}),
    ("int", {"lora": 7}),
    ("int-negative", {"lora": -3}),
    ("int-min", {"n": -(2**63)}),
    ("int-max", {"n": 2**64 - 1}),
    ("bool-true", {"flag": True}),
    ("bool-false", {"flag": False}),
    ("bytes", {"blob": bytes([0, 255, 16])}),
    ("bytes-empty", {"blob": b""}),
    ("list-empty", {"mm": []}),
    ("list-2", {"lora": "sql-adapter", "mm": ["ab12", "cd34"]}),
    ("list-12-order-kept", {"mm": [f"h{i}" for i in range(12)]}),
    ("list-12-reversed", {"mm": [f"h{i}" for i in range(11, -1, -1)]}),
    ("list-nested-mixed", {"nested": [["a", 1], [b"x", True]]}),
]
EXTRA_REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("float", {"x": {"float": "1.5"}}),
    ("map-value", {"x": {"map": {"a": {"str": "b"}}}}),
    ("none-in-list", {"mm": {"list": [{"str": "a"}, None]}}),
    ("int-too-small", {"n": {"int": str(-(2**63) - 1)}}),
    ("int-too-large", {"n": {"int": str(2**64)}}),
    ("non-string-name", {"x": {"int_name": 1}}),
    ("lone-surrogate", {"x": {"surrogate": "d800"}}),
]


def extra_cases() -> dict[str, Any]:
    fingerprint = tiny().fingerprint()
    accepted = []
    for name, extra in EXTRA_ACCEPTED:
        accepted.append(
            {
                "name": name,
                "extra": {k: tagged(v) for k, v in extra.items()},
                "encoded": encode_extra(extra).hex(),
                "namespace_root": namespace_root(fingerprint, extra=extra).hex(),
            }
        )
    # tests/format/test_vectors.py builds each refused input and checks that it is refused
    refused = [{"name": n, "extra": e, "error": "ConfigError"} for n, e in EXTRA_REFUSED]
    return {"fingerprint": fingerprint.hex(), "accepted": accepted, "refused": refused}


# --- chunks.json ----------------------------------------------------------------------------

GOLDEN: list[tuple[str, Callable[[], KVSpec], dict[str, Any]]] = [
    ("tiny-bf16", tiny, {}),
    ("tiny-bf16-mac", tiny, {"mac_secret": MAC_SECRET}),
    ("tiny-bf16-zstd", tiny, {"compression": "zstd"}),
    ("tiny-bf16-mac-zstd", tiny, {"mac_secret": MAC_SECRET, "compression": "zstd"}),
    ("tiny-f16", lambda: tiny("F16"), {}),
    ("tiny-f32", lambda: tiny("F32"), {}),
    ("tiny-i8", lambda: tiny("I8"), {}),
    ("tiny-u8", lambda: tiny("U8"), {}),
    ("tiny-f8-e5m2", lambda: tiny("F8_E5M2"), {}),
    ("mla-fp8", mla, {}),
    ("hybrid-bf16", hybrid, {}),
]


def golden_chunk(spec: KVSpec, options: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    """(chunk bytes, key, parent) of the first chunk of ``spec``."""
    secret = options.get("mac_secret")
    mac_key = mac_key_from_secret(secret) if secret else None
    layout = ChunkLayout(spec, authenticated=mac_key is not None)
    root = namespace_root(spec.fingerprint())
    tokens = tokens_for(spec.chunk_tokens)
    key = key_digest(root, tokens)
    data = bytes(
        encode_chunk(
            layout,
            key=key,
            parent=root,
            namespace=namespace_of(root),
            tokens=tokens,
            tensors=payload_tensors(layout),
            mac_key=mac_key,
        )
    )
    if options.get("compression"):
        data = recompress(data, options["compression"], mac_key=mac_key)
    return data, key, root


def chunk_cases() -> list[tuple[dict[str, Any], bytes]]:
    out = []
    for name, make_spec, options in GOLDEN:
        spec = make_spec()
        data, key, parent = golden_chunk(spec, options)
        case = {
            "file": f"{name}.kvc",
            "spec": spec.to_dict(),
            "options": options,
            "key": key.hex(),
            "parent": parent.hex(),
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        out.append((case, data))
    return out


# --- reader.json ----------------------------------------------------------------------------

_LEN = struct.Struct("<Q")
_CHECKSUM_DIGITS = re.compile(rb'"checksum": ?"xxh3-128:([0-9a-f]{32})')
_MAC_DIGITS = re.compile(rb'"mac":"blake3-keyed:([0-9a-f]{64})')


def split_chunk(data: bytes) -> tuple[bytes, bytes]:
    """(header JSON text without padding, stored payload)."""
    (header_len,) = _LEN.unpack_from(data, 0)
    return data[8 : 8 + header_len].rstrip(b" "), data[8 + header_len :]


def seal(
    text: bytes, stored: bytes, *, mac_secret: str | None = None, padding: bytes = b""
) -> bytes:
    """Pad ``text`` to the alignment (``padding`` first, then spaces) and write MAC and checksum.

    Sections 4.1 and 4.2, computed here without the library: digits found by byte search,
    zeroed, hashed with the stored payload.
    """
    body = text + padding
    body += b" " * (-(8 + len(body)) % ALIGNMENT)
    head = bytearray(_LEN.pack(len(body)) + body)
    checksum = _CHECKSUM_DIGITS.search(head)
    mac = _MAC_DIGITS.search(head)
    assert checksum is not None
    head[checksum.start(1) : checksum.end(1)] = b"0" * 32
    if mac is not None:
        head[mac.start(1) : mac.end(1)] = b"0" * 64
        if mac_secret is not None:
            mac_key = blake3.blake3(
                mac_secret.encode(), derive_key_context="chunkstore 2026-11 chunk mac key v1"
            ).digest()
            digest = blake3.blake3(bytes(head) + stored, key=mac_key).hexdigest()
            head[mac.start(1) : mac.end(1)] = digest.encode()
    digest = xxhash.xxh3_128(bytes(head) + stored).hexdigest()
    head[checksum.start(1) : checksum.end(1)] = digest.encode()
    return bytes(head) + stored


def edit(text: bytes, old: bytes, new: bytes, count: int = 1) -> bytes:
    assert text.count(old) >= count, (old, text[:200])
    return text.replace(old, new, count)


def with_meta(text: bytes, member: bytes) -> bytes:
    """Insert ``,member`` before the checksum member."""
    return edit(text, b',"checksum":', b"," + member + b',"checksum":')


def _collector(out: list[tuple[dict[str, Any], bytes]]) -> Callable[..., None]:
    """A function that appends one reader case (its JSON entry and file bytes) to ``out``."""

    def case(
        name: str,
        section: str,
        defect: str,
        data: bytes,
        error: str | None,
        *,
        verdict: str = "corrupt",
        origin: str = "tiny-bf16.kvc",
        options: dict[str, Any] | None = None,
    ) -> None:
        entry = {
            "file": f"{name}.kvc",
            "from": origin,
            "section": section,
            "defect": defect,
            "options": options or {},
            "verdict": "ok" if error is None else verdict,
            "error": error,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        out.append((entry, data))

    return case


def reader_cases() -> list[tuple[dict[str, Any], bytes]]:
    base, base_key, base_root = golden_chunk(tiny(), {})
    mac_chunk, _, _ = golden_chunk(tiny(), {"mac_secret": MAC_SECRET})
    text, payload = split_chunk(base)
    mac_text, _ = split_chunk(mac_chunk)
    hybrid_chunk, _, _ = golden_chunk(hybrid(), {})
    hybrid_text, hybrid_payload = split_chunk(hybrid_chunk)
    key_hex = base_key.hex().encode()
    tokens_hex = tokens_for(16).astype("<u4").tobytes().hex().encode()
    k15 = key_digest(base_root, tokens_for(15)).hex().encode()
    k17 = key_digest(base_root, tokens_for(17)).hex().encode()
    t17 = tokens_for(17).astype("<u4").tobytes().hex().encode()
    zstd_no_checksum = zstandard.ZstdCompressor(level=3, write_checksum=False).compress(payload)
    zstd_good = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(payload)
    zstd_no_size = zstandard.ZstdCompressor(
        level=3, write_checksum=True, write_content_size=False
    ).compress(payload)

    def zstd_text(stored: bytes) -> bytes:
        return edit(
            edit(text, b'"compression":"none"', b'"compression":"zstd"'),
            b'"stored_size":"1024"',
            b'"stored_size":"%d"' % len(stored),
        )

    flipped = bytearray(base)
    flipped[-1] ^= 0x01
    other_key = key_digest(base_root, tokens_for(16) + 1).hex()
    other_fp = hybrid().fingerprint().hex()
    v11 = edit(text, b'"chunkstore":"1.0"', b'"chunkstore":"1.1"')
    out: list[tuple[dict[str, Any], bytes]] = []

    case = _collector(out)

    # accepted
    case("ok-golden", "3", "none: the golden chunk as written", base, None)
    case(
        "ok-minor-1.1-unknown-field",
        "2",
        'version "1.1" and an extra metadata member "x_note" (a newer minor may add fields)',
        seal(with_meta(v11, b'"x_note":"added in 1.1"'), payload),
        None,
    )
    case(
        "ok-mac-without-reader-key",
        "4.2",
        "none: an authenticated chunk read by a reader without a key",
        mac_chunk,
        None,
        origin="tiny-bf16-mac.kvc",
    )
    case(
        "ok-zstd-with-checksum",
        "4.4",
        "payload stored as one zstd frame with content checksum and content size",
        seal(zstd_text(zstd_good), zstd_good),
        None,
    )
    # unsupported (a newer version): a miss, never damage
    case(
        "unsupported-major-2",
        "2",
        'version "2.0", and whitespace in the JSON (a new major may change anything after it)',
        seal(edit(edit(text, b'"chunkstore":"1.0"', b'"chunkstore":"2.0"'), b",", b", "), payload),
        "UnsupportedVersion",
        verdict="unsupported",
    )
    case(
        "unsupported-minor-1.1-dtype",
        "2",
        'version "1.1" with dtype "F8_E8M0" (itemsize 1) for every tensor',
        seal(edit(v11, b'"dtype":"BF16"', b'"dtype":"F8_E8M0"', 4), payload),
        "UnknownDType",
        verdict="unsupported",
    )
    case(
        "unsupported-minor-1.1-compression",
        "2",
        'version "1.1" with compression "lz4"',
        seal(edit(v11, b'"compression":"none"', b'"compression":"lz4"'), payload),
        "UnknownCompression",
        verdict="unsupported",
    )
    hybrid_v11 = edit(hybrid_text, b'"chunkstore":"1.0"', b'"chunkstore":"1.1"')
    case(
        "unsupported-minor-1.1-tensor-role",
        "2",
        'version "1.1" with "layers.4.state" named "layers.4.conv" (a new layer-group kind)',
        seal(edit(hybrid_v11, b'"layers.4.state"', b'"layers.4.conv"'), hybrid_payload),
        "UnsupportedFeature",
        verdict="unsupported",
        origin="hybrid-bf16.kvc",
    )
    # corrupt: a 1.0 chunk cannot hold what 1.1 may add
    case(
        "malformed-1.0-tensor-role",
        "2",
        'version "1.0" with "layers.4.state" named "layers.4.conv"',
        seal(edit(hybrid_text, b'"layers.4.state"', b'"layers.4.conv"'), hybrid_payload),
        "MalformedHeader",
        origin="hybrid-bf16.kvc",
    )
    case(
        "malformed-1.0-dtype",
        "2",
        'version "1.0" with dtype "F8_E8M0" for every tensor',
        seal(edit(text, b'"dtype":"BF16"', b'"dtype":"F8_E8M0"', 4), payload),
        "MalformedHeader",
    )
    case(
        "malformed-1.0-compression",
        "2",
        'version "1.0" with compression "lz4"',
        seal(edit(text, b'"compression":"none"', b'"compression":"lz4"'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-1.0-unknown-field",
        "2",
        'version "1.0" with an extra metadata member "x_note"',
        seal(with_meta(text, b'"x_note":"not in 1.0"'), payload),
        "MalformedHeader",
    )
    # section 3.1: JSON rules
    case(
        "malformed-duplicate-key-member",
        "3.1",
        'a second "key" member holding key_1 of another token run',
        seal(with_meta(text, b'"key":"' + k17 + b'"'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-duplicate-tensor-member",
        "3.1",
        'a second "dtype" member in the first tensor entry',
        seal(edit(text, b'"dtype":"BF16"', b'"dtype":"BF16","dtype":"F16"'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-duplicate-tensor",
        "3.1",
        'the member "layers.1.k" renamed "layers.0.k" (the same name twice)',
        seal(edit(text, b'"layers.1.k"', b'"layers.0.k"'), payload),
        "MalformedHeader",
    )
    for label, pad in (("newline", b"\n"), ("tab", b"\t"), ("nul", b"\x00")):
        case(
            f"malformed-padding-{label}",
            "3",
            f"the first padding byte is {pad!r} instead of 0x20",
            seal(text, payload, padding=pad),
            "MalformedHeader",
        )
    case(
        "malformed-whitespace-between-tensors",
        "3.1",
        'a space after the comma before "layers.0.v"',
        seal(edit(text, b',"layers.0.v"', b', "layers.0.v"'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-space-in-checksum-member",
        "3.1",
        'a space after the colon of the "checksum" member',
        seal(edit(text, b'"checksum":"', b'"checksum": "'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-escape-in-string",
        "3.1",
        '"none" written as "\\u006eone"',
        seal(edit(text, b'"compression":"none"', b'"compression":"\\u006eone"'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-non-ascii-in-string",
        "3.1",
        'version "1.1" and a metadata member "x_note" holding a UTF-8 "é"',
        seal(with_meta(v11, '"x_note":"caf\u00e9"'.encode()), payload),
        "MalformedHeader",
    )
    case(
        "malformed-uppercase-hex",
        "3.1",
        "the key in upper-case hex",
        seal(edit(text, key_hex, key_hex.upper()), payload),
        "MalformedHeader",
    )
    case(
        "malformed-leading-zero-decimal",
        "3.1",
        'payload_size and stored_size written "01024"',
        seal(edit(text, b'"1024"', b'"01024"', 2), payload),
        "MalformedHeader",
    )
    case(
        "malformed-leading-zero-number",
        "3.1",
        "data_offsets [0,256] written [0,0256]",
        seal(edit(text, b"[0,256]", b"[0,0256]"), payload),
        "MalformedHeader",
    )
    case(
        "malformed-version-leading-zero",
        "2",
        'version "01.0"',
        seal(edit(text, b'"chunkstore":"1.0"', b'"chunkstore":"01.0"'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-tokens-15-for-c-16",
        "3.1",
        "tokens holds 15 tokens (C = 16 from the shapes); key = BLAKE3(parent || 15 tokens)",
        seal(edit(edit(text, tokens_hex, tokens_hex[:-8]), key_hex, k15), payload),
        "MalformedHeader",
    )
    case(
        "malformed-tokens-17-for-c-16",
        "3.1",
        "tokens holds 17 tokens (C = 16 from the shapes); key = BLAKE3(parent || 17 tokens)",
        seal(edit(edit(text, tokens_hex, t17), key_hex, k17), payload),
        "MalformedHeader",
    )
    case(
        "malformed-tensor-name",
        "3.2",
        'tensor "layers.0.k" named "layers.00.k"',
        seal(edit(text, b'"layers.0.k"', b'"layers.00.k"'), payload),
        "MalformedHeader",
    )
    case(
        "malformed-v-before-k",
        "3.2",
        'names of "layers.0.k" and "layers.0.v" swapped (offsets unchanged)',
        seal(
            edit(
                edit(edit(text, b'"layers.0.k"', b'"TMP"'), b'"layers.0.v"', b'"layers.0.k"'),
                b'"TMP"',
                b'"layers.0.v"',
            ),
            payload,
        ),
        "MalformedHeader",
    )
    case(
        "malformed-mixed-dtypes",
        "3.2",
        'the last tensor "F16" (same itemsize), the others "BF16"',
        seal(
            text[: text.rindex(b'"BF16"')] + b'"F16"' + text[text.rindex(b'"BF16"') + 6 :], payload
        ),
        "MalformedHeader",
    )
    case(
        "malformed-extra-tensor-member",
        "3.1",
        'a member "offsets_note":"x" in the first tensor entry',
        seal(edit(text, b'"dtype":"BF16"', b'"dtype":"BF16","offsets_note":"x"'), payload),
        "MalformedHeader",
    )
    case(
        "layout-out-of-order",
        "3.2",
        'state tensor of layer 4 moved before "layers.0.k" in the header (offsets unchanged)',
        seal(
            hybrid_text[: hybrid_text.index(b',"layers.0.k"')]
            + hybrid_text[hybrid_text.index(b',"layers.4.state"') : -1]
            + hybrid_text[
                hybrid_text.index(b',"layers.0.k"') : hybrid_text.index(b',"layers.4.state"')
            ]
            + b"}",
            hybrid_payload,
        ),
        "LayoutError",
        origin="hybrid-bf16.kvc",
    )
    case(
        "layout-hole",
        "3.2",
        "data_offsets of the last tensor [768,1024] moved to [770,1026], payload_size 1026",
        seal(
            edit(edit(text, b"[768,1024]", b"[770,1026]"), b'"1024"', b'"1026"', 2),
            payload + b"\x00\x00",
        ),
        "LayoutError",
    )
    case(
        "layout-trailing-bytes",
        "3",
        "one byte after the stored payload",
        base + b"\x00",
        "LayoutError",
    )
    case("truncated", "3", "the last payload byte removed", base[:-1], "TruncatedChunk")
    case("bad-magic", "3", "first header byte changed", base[:8] + b"[" + base[9:], "BadMagic")
    case(
        "header-too-large",
        "3",
        "header_len = 16 MiB + 1, so the input is also shorter than its header: group 3 "
        "checks the limit before the length",
        _LEN.pack(16 * 1024 * 1024 + 1) + base[8:],
        "HeaderTooLarge",
    )
    out.extend(readings_cases(base, text, payload, mac_text, hybrid_text, hybrid_payload))
    # section 4
    case(
        "checksum-payload-bit",
        "4.1",
        "last payload bit flipped",
        bytes(flipped),
        "ChecksumMismatch",
    )
    case(
        "key-not-derivable",
        "4.3",
        "key replaced by BLAKE3(parent || other tokens)",
        seal(edit(text, key_hex, other_key.encode()), payload),
        "KeyMismatch",
    )
    case(
        "key-not-the-expected",
        "4.3",
        "none; the reader asked for another key",
        base,
        "KeyMismatch",
        options={"expected_key": other_key},
    )
    case(
        "spec-not-the-expected",
        "4.3",
        "none; the reader expects the fingerprint of vectors/hybrid",
        base,
        "SpecMismatch",
        verdict="refused",
        options={"expected_fingerprint": other_fp},
    )
    case(
        "mac-missing",
        "4.2",
        "none; the reader holds a MAC secret and the chunk has no mac",
        base,
        "AuthenticationError",
        verdict="refused",
        options={"mac_secret": MAC_SECRET},
    )
    case(
        "mac-wrong",
        "4.2",
        "MAC computed with another secret, checksum correct",
        seal(mac_text, payload, mac_secret="another secret"),
        "AuthenticationError",
        verdict="refused",
        origin="tiny-bf16-mac.kvc",
        options={"mac_secret": MAC_SECRET},
    )
    case(
        "zstd-no-checksum",
        "4.4",
        "zstd frame without a content checksum",
        seal(zstd_text(zstd_no_checksum), zstd_no_checksum),
        "CompressionError",
    )
    case(
        "zstd-no-content-size",
        "4.4",
        "zstd frame without a content size",
        seal(zstd_text(zstd_no_size), zstd_no_size),
        "CompressionError",
    )
    two_frames = zstd_good + zstd_good
    case(
        "zstd-two-frames",
        "4.4",
        "the frame twice (stored_size counts both)",
        seal(zstd_text(two_frames), two_frames),
        "CompressionError",
    )
    return out


def readings_cases(
    base: bytes,
    text: bytes,
    payload: bytes,
    mac_text: bytes,
    hybrid_text: bytes,
    hybrid_payload: bytes,
) -> list[tuple[dict[str, Any], bytes]]:
    """Text revision 3 (issue #23): one vector per reading settled there."""
    out: list[tuple[dict[str, Any], bytes]] = []

    case = _collector(out)

    def flip_last_bit(data: bytes) -> bytes:
        damaged = bytearray(data)
        damaged[-1] ^= 0x01
        return bytes(damaged)

    v11 = edit(text, b'"chunkstore":"1.0"', b'"chunkstore":"1.1"')
    version_end = 8 + len(b'{"__metadata__":{"chunkstore":"1.0')
    # section 2.2 / 3.4 group 2: the version field
    case(
        "truncated-inside-version",
        "2",
        'the input ends inside the version string (after "1."): input that ends before the '
        "closing quote is truncated, whatever the bytes so far",
        base[: version_end - 1],
        "TruncatedChunk",
    )
    case(
        "header-len-inside-version",
        "2",
        "header_len = 33: the header would end inside the version string (nothing else changed)",
        _LEN.pack(33) + base[8:],
        "MalformedHeader",
    )
    case(
        "header-len-below-magic",
        "2",
        "header_len = 20: magic and version lie past the header's end",
        _LEN.pack(20) + base[8:],
        "MalformedHeader",
    )
    major2 = seal(edit(text, b'"chunkstore":"1.0"', b'"chunkstore":"2.0"'), payload)
    case(
        "header-len-inside-version-major-2",
        "2",
        'version "2.0" and header_len = 33: malformed in every major, so not unsupported',
        _LEN.pack(33) + major2[8:],
        "MalformedHeader",
    )
    flipped_major = bytearray(base)
    flipped_major[version_end - 3] ^= 0x02  # "1.0" -> "3.0": one bit of the major digit
    case(
        "unsupported-major-bit-flip",
        "2",
        'one bit of the major digit flipped ("1.0" becomes "3.0"), not resealed: an unknown '
        "major cannot be checked (a store ages it out or a writer replaces it, section 6.7)",
        bytes(flipped_major),
        "UnsupportedVersion",
        verdict="unsupported",
    )
    # section 3.4: a known major's seal is checked before its unknown additions
    for label, edited, error_origin in (
        ("compression", edit(v11, b'"compression":"none"', b'"compression":"lz4"'), None),
        ("dtype", edit(v11, b'"dtype":"BF16"', b'"dtype":"F8_E8M0"', 4), None),
        (
            "tensor-role",
            edit(
                edit(hybrid_text, b'"chunkstore":"1.0"', b'"chunkstore":"1.1"'),
                b'"layers.4.state"',
                b'"layers.4.conv"',
            ),
            "hybrid-bf16.kvc",
        ),
    ):
        stored = hybrid_payload if error_origin else payload
        case(
            f"checksum-minor-1.1-{label}",
            "3.4",
            f"the unsupported-minor-1.1-{label} chunk with its last payload bit flipped: "
            "the checksum is checked before the unknown addition, so it is corrupt",
            flip_last_bit(seal(edited, stored)),
            "ChecksumMismatch",
            origin=error_origin or "tiny-bf16.kvc",
        )
    mac_v11 = edit(
        edit(mac_text, b'"chunkstore":"1.0"', b'"chunkstore":"1.1"'),
        b'"compression":"none"',
        b'"compression":"lz4"',
    )
    case(
        "mac-wrong-minor-1.1-compression",
        "3.4",
        'version "1.1" with compression "lz4", MAC computed with another secret: the MAC is '
        "checked before the unknown compression",
        seal(mac_v11, payload, mac_secret="another secret"),
        "AuthenticationError",
        verdict="refused",
        origin="tiny-bf16-mac.kvc",
        options={"mac_secret": MAC_SECRET},
    )
    # section 3.1: field formats before the tensor table; compression none sizes
    case(
        "payload-size-not-decimal",
        "3.1",
        'payload_size written "abc": field formats are checked before the tensor table',
        seal(edit(text, b'"payload_size":"1024"', b'"payload_size":"abc"'), payload),
        "MalformedHeader",
    )
    case(
        "stored-size-not-payload-size",
        "3.1",
        'compression "none" with stored_size "1025" and one more stored byte',
        seal(edit(text, b'"stored_size":"1024"', b'"stored_size":"1025"'), payload + b"\0"),
        "MalformedHeader",
    )
    meta_only = text[: text.index(b',"layers.0.k"')] + b"}"
    meta_only = edit(meta_only, b'"payload_size":"1024"', b'"payload_size":"0"')
    meta_only = edit(meta_only, b'"stored_size":"1024"', b'"stored_size":"0"')
    case(
        "no-tensors",
        "3.1",
        "a header with __metadata__ only (payload_size and stored_size 0, no payload): a "
        "chunk has at least one tensor",
        seal(meta_only, b""),
        "MalformedHeader",
    )
    # section 3.2: sizes in exact arithmetic
    wrapped = b"[4294967296,16,4294967296]"
    huge = edit(
        edit(
            text,
            b'"shape":[2,16,4],"data_offsets":[512,768]',
            b'"shape":%s,"data_offsets":[512,512]' % wrapped,
        ),
        b'"shape":[2,16,4],"data_offsets":[768,1024]',
        b'"shape":%s,"data_offsets":[512,512]' % wrapped,
    )
    huge = edit(
        edit(huge, b'"payload_size":"1024"', b'"payload_size":"512"'),
        b'"stored_size":"1024"',
        b'"stored_size":"512"',
    )
    case(
        "layout-size-wraps-u64",
        "3.2",
        "layers.1.k and layers.1.v of shape [2^32, 16, 2^32] BF16 (2^69 bytes, 0 modulo 2^64) "
        "with empty data_offsets [512,512], payload cut to 512 bytes",
        seal(huge, payload[:512]),
        "LayoutError",
    )
    # section 3: padding
    case(
        "ok-padding-not-minimal",
        "3",
        "4096 more spaces of padding than needed (writers pad minimally, readers accept more)",
        seal(text, payload, padding=b" " * 4096),
        None,
    )
    # section 4.2: the secret's bytes
    utf8_chunk, _, _ = golden_chunk(tiny(), {"mac_secret": UTF8_SECRET})
    case(
        "ok-mac-utf8-secret",
        "4.2",
        f"none: authenticated with the secret {UTF8_SECRET!r}, read by a reader holding it "
        "(the key is derived from the UTF-8 bytes of the text)",
        utf8_chunk,
        None,
        origin="tiny-bf16-mac.kvc",
        options={"mac_secret": UTF8_SECRET},
    )
    # section 4.3: the namespace field
    other_ns = edit(text, b'"namespace":"c3e3247db5e503f3"', b'"namespace":"0123456789abcdef"')
    moved = seal(other_ns, payload)
    case(
        "ok-namespace-not-known",
        "4.3",
        'namespace field changed to "0123456789abcdef": a reader that was not told the '
        "namespace it looked in cannot check it",
        moved,
        None,
    )
    case(
        "namespace-not-the-expected",
        "4.3",
        'the same chunk read by a reader that looked in namespace "c3e3247db5e503f3"',
        moved,
        "KeyMismatch",
        options={"expected_namespace": "c3e3247db5e503f3"},
    )
    return out


# --- tp.json --------------------------------------------------------------------------------


def tp_cases() -> list[dict[str, Any]]:
    specs = [
        KVSpec.simple("vectors/tp24", num_layers=2, num_kv_heads=24, head_dim=2, chunk_tokens=4),
        KVSpec.simple("vectors/tp2", num_layers=2, num_kv_heads=2, head_dim=2, chunk_tokens=4),
        KVSpec(
            "vectors/tp-mixed",
            "F16",
            4,
            (
                LayerGroup(ATTENTION, (0,), 8, 2),
                LayerGroup(SLIDING_WINDOW, (1,), 4, 2, sliding_window=16),
                LayerGroup(MLA, (2,), 1, 4),
                LayerGroup(STATE, (3,), state_shape=(2, 3)),
            ),
        ),
    ]
    cases = []
    for spec in specs:
        layout = ChunkLayout(spec)
        for tp in (1, 2, 3, 4, 8):
            case: dict[str, Any] = {
                "spec": spec.to_dict(),
                "data_offset": layout.data_offset,
                "payload_size": layout.payload_size,
                "tp": tp,
            }
            try:
                case["ranks"] = [
                    {
                        "read": [[r.offset, r.length] for r in layout.rank_ranges(rank, tp)],
                        "write": [
                            [r.offset, r.length]
                            for r in layout.rank_ranges(rank, tp, for_write=True)
                        ],
                    }
                    for rank in range(tp)
                ]
            except ConfigError:
                case["error"] = "ConfigError"
            cases.append(case)
    return cases


def _dump(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=1, ensure_ascii=True) + "\n").encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    chunks = chunk_cases()
    readers = reader_cases()
    files = {
        VECTORS / "keys.json": _dump(
            {"_comment": KEY_COMMENT, "cases": key_cases(), "refused": refused_spec_cases()}
        ),
        VECTORS / "extra.json": _dump({"_comment": EXTRA_COMMENT, **extra_cases()}),
        VECTORS / "chunks.json": _dump(
            {"_comment": CHUNK_COMMENT, "cases": [c for c, _ in chunks]}
        ),
        VECTORS / "reader.json": _dump(
            {"_comment": READER_COMMENT, "cases": [c for c, _ in readers]}
        ),
        VECTORS / "tp.json": _dump({"_comment": TP_COMMENT, "cases": tp_cases()}),
    }
    for case, data in chunks:
        files[VECTORS / "chunks" / case["file"]] = data
    for case, data in readers:
        files[VECTORS / "reader" / case["file"]] = data
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
