"""The library reproduces spec/vectors/ byte for byte and reaches every verdict they name.

keys.json and extra.json: fingerprints, encode_extra bytes, roots and chain keys (also
recomputed here from the spec's formulas with nothing but BLAKE3). chunks.json: golden
chunks, re-encoded byte for byte. reader.json: each file decodes to the named error class
(or none). tp.json: every rank's read and write byte ranges. Every corpus must be non-empty.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest

from chunkstore import errors
from chunkstore.backends.base import verdict_of
from chunkstore.errors import ConfigError
from chunkstore.format import (
    ChunkLayout,
    KVSpec,
    decode_chunk,
    encode_chunk,
    key_digest,
    mac_key_from_secret,
    recompress,
)
from chunkstore.hashing import chain_keys, encode_extra, namespace_of, namespace_root

VECTORS = Path(__file__).resolve().parents[2] / "spec" / "vectors"
KEY_CASES = json.loads((VECTORS / "keys.json").read_text())["cases"]
REFUSED_SPECS = json.loads((VECTORS / "keys.json").read_text())["refused"]
EXTRA = json.loads((VECTORS / "extra.json").read_text())
CHUNK_CASES = json.loads((VECTORS / "chunks.json").read_text())["cases"]
READER_CASES = json.loads((VECTORS / "reader.json").read_text())["cases"]
TP_CASES = json.loads((VECTORS / "tp.json").read_text())["cases"]


def _tokens(length: int) -> np.ndarray:
    return ((np.arange(length, dtype=np.uint64) * 2654435761) % 2**32).astype(np.uint32)


def test_vector_corpus_is_present() -> None:
    assert len(KEY_CASES) >= 30
    assert any(case["keys"] for case in KEY_CASES)
    assert len(EXTRA["accepted"]) >= 15 and len(EXTRA["refused"]) >= 5
    assert len(CHUNK_CASES) >= 11
    assert {c["spec"]["dtype"] for c in CHUNK_CASES} >= {
        "BF16", "F16", "F32", "I8", "U8", "F8_E4M3", "F8_E5M2"
    }  # fmt: skip
    assert len(READER_CASES) >= 40
    assert {c["verdict"] for c in READER_CASES} == {"ok", "unsupported", "refused", "corrupt"}
    assert len(REFUSED_SPECS) >= 15
    assert {c["tp"] for c in TP_CASES} == {1, 2, 3, 4, 8}
    for case in CHUNK_CASES:
        assert (VECTORS / "chunks" / case["file"]).is_file()
    for case in READER_CASES:
        assert (VECTORS / "reader" / case["file"]).is_file()


# --- keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", KEY_CASES, ids=lambda c: f"{c['spec']['model_id']}-{c['num_tokens']}"
)
def test_key_vectors(case: dict[str, Any]) -> None:
    spec = KVSpec.from_dict(case["spec"])
    assert spec.canonical_json().decode("ascii") == case["canonical_json"]
    assert spec.fingerprint().hex() == case["fingerprint"]
    root = namespace_root(spec.fingerprint(), extra=case["extra"])
    assert root.hex() == case["namespace_root"]
    assert namespace_of(root) == case["namespace"]
    keys = chain_keys(_tokens(case["num_tokens"]), root=root, chunk_tokens=spec.chunk_tokens)
    assert [k.hex for k in keys] == case["keys"]
    assert all(k.namespace == case["namespace"] for k in keys)


def _spec_canonical_json(value: Any) -> str:
    """Section 5.1 as written: sorted members, no spaces, ASCII only, lower-case \\u escapes
    of UTF-16 code units for everything outside 0x20..0x7e (two-letter escapes for
    \\b \\f \\n \\r \\t), integers in plain decimal."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r"}
        short["\t"] = "\\t"
        out = []
        for char in value:
            if char in short:
                out.append(short[char])
            elif 0x20 <= ord(char) <= 0x7E:
                out.append(char)
            else:
                units = char.encode("utf-16-be")
                out += [f"\\u{units[i : i + 2].hex()}" for i in range(0, len(units), 2)]
        return '"' + "".join(out) + '"'
    if isinstance(value, list):
        return "[" + ",".join(_spec_canonical_json(v) for v in value) + "]"
    members = sorted(value.items())
    return (
        "{"
        + ",".join(f"{_spec_canonical_json(k)}:{_spec_canonical_json(v)}" for k, v in members)
        + "}"
    )


@pytest.mark.parametrize("case", KEY_CASES[::3], ids=lambda c: f"formula-{c['spec']['model_id']}")
def test_key_vectors_follow_the_spec_formula(case: dict[str, Any]) -> None:
    """Recompute fingerprint and chain with nothing but BLAKE3, as spec/FORMAT.md states it."""
    assert _spec_canonical_json(case["spec"]) == case["canonical_json"]
    assert blake3.blake3(case["canonical_json"].encode()).hexdigest() == case["fingerprint"]
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


# --- extra ----------------------------------------------------------------------------------


def _untag(value: Any) -> Any:
    if value is None:
        return None
    (kind, inner), *_ = value.items()
    return {
        "str": lambda: inner,
        "bool": lambda: inner,
        "int": lambda: int(inner),
        "bytes": lambda: bytes.fromhex(inner),
        "list": lambda: [_untag(v) for v in inner],
    }[kind]()


def _spec_encode(pairs: list[tuple[str, Any]]) -> bytes:
    """Section 5.2 as written, independently of the library."""
    out = b""
    for name, value in pairs:
        if isinstance(value, bool):
            encoded = b"s" + (b"True" if value else b"False")
        elif isinstance(value, int):
            encoded = b"s" + str(value).encode()
        elif isinstance(value, str):
            encoded = b"s" + value.encode()
        elif isinstance(value, bytes):
            encoded = b"b" + value
        else:
            encoded = b"l" + _spec_encode([(str(i), v) for i, v in enumerate(value)])
        raw = name.encode()
        out += len(raw).to_bytes(4, "little") + raw + len(encoded).to_bytes(8, "little") + encoded
    return out


@pytest.mark.parametrize("case", EXTRA["accepted"], ids=lambda c: c["name"])
def test_extra_vectors(case: dict[str, Any]) -> None:
    extra = {name: _untag(value) for name, value in case["extra"].items()}
    assert encode_extra(extra).hex() == case["encoded"]
    present = sorted(((k, v) for k, v in extra.items() if v is not None), key=lambda p: p[0])
    assert _spec_encode(present).hex() == case["encoded"]
    fingerprint = bytes.fromhex(EXTRA["fingerprint"])
    assert namespace_root(fingerprint, extra=extra).hex() == case["namespace_root"]
    by_spec = blake3.blake3(
        fingerprint + bytes.fromhex(case["encoded"]),
        derive_key_context="chunkstore 2026-11 namespace root v1",
    )
    assert by_spec.hexdigest() == case["namespace_root"]


def _refused_input(extra: dict[str, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, value in extra.items():
        kind, inner = next(iter(value.items()))
        if kind == "float":
            out[name] = float(inner)
        elif kind == "map":
            out[name] = {k: _untag(v) for k, v in inner.items()}
        elif kind == "list":
            out[name] = [_untag(v) for v in inner]
        elif kind == "int":
            out[name] = int(inner)
        elif kind == "int_name":
            out[inner] = "v"
        else:
            out[name] = chr(int(inner, 16))  # a lone UTF-16 surrogate
    return out


@pytest.mark.parametrize("case", EXTRA["refused"], ids=lambda c: c["name"])
def test_refused_extra_vectors(case: dict[str, Any]) -> None:
    assert case["error"] == "ConfigError"
    with pytest.raises(ConfigError):
        namespace_root(bytes.fromhex(EXTRA["fingerprint"]), extra=_refused_input(case["extra"]))


def test_lists_keep_their_order_and_are_not_sorted_by_index_text() -> None:
    by_name = {c["name"]: c for c in EXTRA["accepted"]}
    assert by_name["list-12-order-kept"]["encoded"] != by_name["list-12-reversed"]["encoded"]
    twelve = [f"h{i}" for i in range(12)]
    assert encode_extra({"mm": twelve}).hex() == by_name["list-12-order-kept"]["encoded"]


# --- golden chunks --------------------------------------------------------------------------


def _payload(layout: ChunkLayout) -> dict[str, np.ndarray]:
    payload = ((np.arange(layout.payload_size, dtype=np.uint64) * 7 + 3) % 251).astype(np.uint8)
    if layout.dtype.itemsize == 2:
        payload[1::2] &= 0x3F
    return {
        s.name: payload[s.offset : s.offset + s.nbytes].view(layout.dtype.numpy).reshape(s.shape)
        for s in layout.tensors
    }


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: c["file"])
def test_golden_chunks_exact_bytes(case: dict[str, Any]) -> None:
    golden = (VECTORS / "chunks" / case["file"]).read_bytes()
    assert hashlib.sha256(golden).hexdigest() == case["sha256"]
    assert len(golden) == case["size"]
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
        assert bytes(decode_chunk(golden, mac_key=mac_key).payload) == bytes(
            decode_chunk(data).payload
        )
        data = recompress(data, case["options"]["compression"], mac_key=mac_key)
        assert (
            decode_chunk(data, mac_key=mac_key).header.tokens == decode_chunk(golden).header.tokens
        )
    else:
        assert data == golden
    chunk = decode_chunk(golden, mac_key=mac_key, expected_fingerprint=spec.fingerprint())
    assert chunk.header.key.hex() == case["key"]
    assert chunk.header.parent.hex() == case["parent"]


# --- reader verdicts ------------------------------------------------------------------------


@pytest.mark.parametrize("case", READER_CASES, ids=lambda c: c["file"])
def test_reader_vectors(case: dict[str, Any]) -> None:
    data = (VECTORS / "reader" / case["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == case["sha256"]
    options = case["options"]
    kwargs: dict[str, Any] = {}
    if "mac_secret" in options:
        kwargs["mac_key"] = mac_key_from_secret(options["mac_secret"])
    if "expected_key" in options:
        kwargs["expected_key"] = bytes.fromhex(options["expected_key"])
    if "expected_fingerprint" in options:
        kwargs["expected_fingerprint"] = bytes.fromhex(options["expected_fingerprint"])
    if "expected_namespace" in options:
        kwargs["expected_namespace"] = options["expected_namespace"]
    if case["error"] is None:
        decode_chunk(data, **kwargs)
        return
    error = getattr(errors, case["error"])
    with pytest.raises(error) as raised:
        decode_chunk(data, **kwargs)
    assert type(raised.value) is error
    # The spec's verdict words are the library's (ReadVerdict's values) and the CLI's.
    assert verdict_of(raised.value).value == case["verdict"]


@pytest.mark.parametrize("case", REFUSED_SPECS, ids=lambda c: c["why"])
def test_refused_spec_vectors(case: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        KVSpec.from_dict(case["spec"])


# --- TP ranges ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: f"{c['spec']['model_id']}-tp{c['tp']}")
def test_tp_range_vectors(case: dict[str, Any]) -> None:
    layout = ChunkLayout(KVSpec.from_dict(case["spec"]))
    assert (layout.data_offset, layout.payload_size) == (case["data_offset"], case["payload_size"])
    tp = case["tp"]
    if "error" in case:
        with pytest.raises(ConfigError):
            layout.rank_ranges(0, tp)
        return
    for rank, expected in enumerate(case["ranks"]):
        read = [[r.offset, r.length] for r in layout.rank_ranges(rank, tp)]
        write = [[r.offset, r.length] for r in layout.rank_ranges(rank, tp, for_write=True)]
        assert (read, write) == (expected["read"], expected["write"])
    written = sorted(tuple(r) for rank in case["ranks"] for r in rank["write"])
    covered = [layout.data_offset]
    for offset, length in written:  # the writers together fill the payload exactly once
        assert offset == covered[-1]
        covered.append(offset + length)
    assert covered[-1] == layout.total_size
