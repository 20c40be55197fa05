"""Encode/decode round trips for random specs, dtypes and token counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from chunkstore.errors import (
    AuthenticationError,
    ChecksumMismatch,
    ConfigError,
    FormatError,
    KeyMismatch,
    SpecMismatch,
)
from chunkstore.format import (
    ALIGNMENT,
    ATTENTION,
    SLIDING_WINDOW,
    ChunkLayout,
    KVSpec,
    LayerGroup,
    chain_link,
    decode_chunk,
    decode_into,
    encode_chunk,
    key_digest,
    mac_key_from_secret,
    read_header,
    recompress,
)
from chunkstore.format import _template as template_module
from chunkstore.hashing import namespace_of, namespace_root
from tests.format.strategies import kv_specs, random_tensors


def _encode(layout: ChunkLayout, seed: int, **kwargs):
    root = namespace_root(layout.fingerprint)
    tokens = np.random.default_rng(seed).integers(
        0, 2**32, layout.spec.chunk_tokens, dtype=np.uint64
    )
    tokens = tokens.astype(np.uint32)
    tensors = random_tensors(layout, seed)
    key = key_digest(root, tokens)
    data = encode_chunk(
        layout,
        key=key,
        parent=root,
        namespace=namespace_of(root),
        tokens=tokens,
        tensors=tensors,
        **kwargs,
    )
    return data, tensors, tokens, key, root


@given(kv_specs(), st.integers(0, 2**31))
def test_round_trip_preserves_every_byte(spec: KVSpec, seed: int) -> None:
    layout = ChunkLayout(spec)
    data, tensors, tokens, key, root = _encode(layout, seed)
    assert len(data) == layout.total_size
    assert layout.data_offset % ALIGNMENT == 0
    chunk = decode_chunk(data, expected_key=key, expected_fingerprint=spec.fingerprint())
    assert chunk.header.key == key and chunk.header.parent == root
    assert chunk.header.tokens == tuple(int(t) for t in tokens)
    assert chunk.header.fingerprint == spec.fingerprint()
    assert [e.name for e in chunk.header.tensors] == [s.name for s in layout.tensors]
    for name, source in tensors.items():
        assert chunk.tensor(name).tobytes() == source.tobytes()


@given(kv_specs(), st.integers(0, 2**31))
def test_zstd_round_trip(spec: KVSpec, seed: int) -> None:
    layout = ChunkLayout(spec)
    data, tensors, *_ = _encode(layout, seed)
    packed = recompress(data, "zstd")
    chunk = decode_chunk(packed)
    assert chunk.header.compression == "zstd"
    assert bytes(chunk.payload) == bytes(decode_chunk(data).payload)
    assert recompress(packed, "none") == bytes(data)


@given(kv_specs(), st.integers(0, 2**31))
def test_decode_into_caller_arrays(spec: KVSpec, seed: int) -> None:
    layout = ChunkLayout(spec)
    data, tensors, *_ = _encode(layout, seed)
    targets = {name: np.empty_like(t) for name, t in tensors.items()}
    decode_chunk(data).copy_into(targets)
    for name in tensors:
        assert targets[name].tobytes() == tensors[name].tobytes()


def test_encode_into_caller_buffer_and_decode_views_without_copy() -> None:
    layout = ChunkLayout(
        KVSpec.simple("m", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=8)
    )
    out = bytearray(layout.total_size)
    data, tensors, *_ = _encode(layout, 7, out=out)
    assert data is out
    chunk = decode_chunk(memoryview(out))
    view = chunk.tensor("layers.1.v")
    assert np.shares_memory(view, np.frombuffer(out, np.uint8))


def test_uncompressed_chunk_is_a_safetensors_file(tmp_path) -> None:
    spec = KVSpec.simple(
        "m", num_layers=3, num_kv_heads=2, head_dim=8, chunk_tokens=16, dtype="F16"
    )
    layout = ChunkLayout(spec)
    data, tensors, *_ = _encode(layout, 3)
    path = tmp_path / "c.kvc"
    path.write_bytes(data)
    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["chunkstore"] == "1.0"
        assert sorted(f.keys()) == sorted(tensors)
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            assert f.get_tensor(name).tobytes() == tensors[name].tobytes()


def test_mac_is_required_when_reader_holds_key() -> None:
    spec = KVSpec.simple("m", num_layers=1, num_kv_heads=1, head_dim=4, chunk_tokens=4)
    secret = mac_key_from_secret("team secret")
    signed, *_ = _encode(ChunkLayout(spec, authenticated=True), 1, mac_key=secret)
    plain, *_ = _encode(ChunkLayout(spec), 1)
    decode_chunk(signed, mac_key=secret)
    decode_chunk(signed)  # readers without the key still read it
    with pytest.raises(AuthenticationError):
        decode_chunk(plain, mac_key=secret)
    with pytest.raises(AuthenticationError):
        decode_chunk(signed, mac_key=mac_key_from_secret("other secret"))
    assert read_header(signed).mac is not None


def test_expected_key_and_fingerprint_are_checked() -> None:
    spec = KVSpec.simple("m", num_layers=1, num_kv_heads=1, head_dim=4, chunk_tokens=4)
    data, *_ = _encode(ChunkLayout(spec), 1)
    with pytest.raises(KeyMismatch):
        decode_chunk(data, expected_key=bytes(32))
    with pytest.raises(SpecMismatch):
        decode_chunk(data, expected_fingerprint=bytes(32))


def test_seal_refuses_a_key_that_does_not_chain() -> None:
    layout = ChunkLayout(
        KVSpec.simple("m", num_layers=1, num_kv_heads=1, head_dim=4, chunk_tokens=4)
    )
    tensors = random_tensors(layout, 0)
    with pytest.raises(KeyMismatch):
        encode_chunk(
            layout,
            key=bytes(32),
            parent=bytes(32),
            namespace="0" * 16,
            tokens=[1, 2, 3, 4],
            tensors=tensors,
        )
    with pytest.raises(ConfigError):
        encode_chunk(
            layout,
            key=bytes(32),
            parent=bytes(32),
            namespace="0" * 16,
            tokens=[1, 2, 3],
            tensors=tensors,
        )


def test_all_chunks_of_a_spec_have_one_size() -> None:
    layout = ChunkLayout(
        KVSpec.simple("m", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=8)
    )
    sizes = {len(_encode(layout, seed)[0]) for seed in range(5)}
    assert sizes == {layout.total_size}


def test_spec_round_trips_through_dict_and_rejects_nonsense() -> None:
    spec = KVSpec.simple("llama", num_layers=4, num_kv_heads=8, head_dim=128)
    assert KVSpec.from_dict(spec.to_dict()) == spec
    assert KVSpec.from_dict(spec.to_dict()).fingerprint() == spec.fingerprint()
    with pytest.raises(ConfigError):
        KVSpec.from_dict({"model_id": "x"})
    with pytest.raises(ConfigError):
        KVSpec.simple("x", num_layers=1, num_kv_heads=1, head_dim=1, dtype="complex128")


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVSpec.simple("x", num_layers=1, num_kv_heads=1, head_dim=2.0),  # type: ignore[arg-type]
        lambda: KVSpec.simple("x", num_layers=1, num_kv_heads=True, head_dim=2),
        lambda: KVSpec.simple("x", num_layers=1, num_kv_heads=1, head_dim=2, chunk_tokens=4.0),  # type: ignore[arg-type]
        lambda: KVSpec.simple("\ud800", num_layers=1, num_kv_heads=1, head_dim=2),
        lambda: KVSpec("x", "BF16", 4, (LayerGroup(SLIDING_WINDOW, (0,), 1, 2, sliding_window=0),)),
        lambda: KVSpec("x", "BF16", 4, (LayerGroup(ATTENTION, (0,), 1, 2),), extra=(("k", 1),)),  # type: ignore[arg-type]
    ],
)
def test_spec_fields_that_canonical_json_cannot_spell_one_way_are_refused(make) -> None:
    """Section 5.1: integers are integers and strings valid Unicode, never a language's print."""
    with pytest.raises(ConfigError):
        make()


@given(kv_specs(), st.integers(0, 2**31), st.booleans())
def test_decode_into_fused_path_matches_and_detects_damage(
    spec: KVSpec, seed: int, verify: bool
) -> None:
    layout = ChunkLayout(spec)
    data, tensors, *_ = _encode(layout, seed)
    targets = {name: np.zeros_like(t) for name, t in tensors.items()}
    header = decode_into(data, targets, verify=verify)
    assert header.key == decode_chunk(data).header.key
    assert all(targets[n].tobytes() == tensors[n].tobytes() for n in tensors)
    damaged = bytearray(data)
    damaged[-1] ^= 0x10
    if verify:
        with pytest.raises(ChecksumMismatch):
            decode_into(damaged, targets)


def test_known_template_fast_path_agrees_with_json_parser(monkeypatch) -> None:
    spec = KVSpec.simple("m", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=8)
    data, *_ = _encode(ChunkLayout(spec, authenticated=True), 5, mac_key=mac_key_from_secret("k"))
    fast = read_header(data)
    monkeypatch.setattr(template_module, "_KNOWN_TEMPLATES", {})
    slow = read_header(data)
    assert fast == slow
    assert fast.tokens == slow.tokens and len(fast.tokens) == 8


def _header_verdict(data: bytes) -> object:
    try:
        return read_header(data)
    except FormatError as exc:
        return type(exc)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_known_template_fast_path_same_verdict_on_damaged_headers(data: st.DataObject) -> None:
    """Any byte of a header changed: the template path and the JSON parser agree (same header,
    or the same error class)."""
    spec = KVSpec.simple("m", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=8)
    chunk, *_ = _encode(ChunkLayout(spec), 3)
    offset = read_header(chunk).data_offset
    damaged = bytearray(chunk)
    position = data.draw(st.integers(0, offset - 1), label="position")
    damaged[position] = data.draw(st.integers(0, 255).filter(lambda b: b != chunk[position]))
    fast = _header_verdict(bytes(damaged))
    saved = dict(template_module._KNOWN_TEMPLATES)
    template_module._KNOWN_TEMPLATES.clear()
    try:
        slow = _header_verdict(bytes(damaged))
    finally:
        template_module._KNOWN_TEMPLATES.update(saved)
    assert fast == slow


def test_a_reader_learns_the_template_of_a_header_it_parsed(monkeypatch) -> None:
    """A process that never built the layout parses a chunk once as JSON, then by position;
    a header this library would render differently is never learned."""
    spec = KVSpec.simple("m", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=8)
    chunk, *_ = _encode(ChunkLayout(spec), 9)
    monkeypatch.setattr(template_module, "_KNOWN_TEMPLATES", {})
    monkeypatch.setattr(template_module, "_UNLEARNABLE", set())
    slow = read_header(chunk)
    assert len(template_module._KNOWN_TEMPLATES) == 1
    assert read_header(chunk) == slow
    (bucket,) = template_module._KNOWN_TEMPLATES.values()
    assert bucket[0][0].raw[:40] == chunk[:40]

    # The same header with its metadata fields in another order: valid, but not ours.
    header = read_header(chunk)
    raw = bytearray(chunk[: header.data_offset])
    body = bytes(raw[8:]).rstrip(b" ")
    sizes = f'"payload_size":"{header.payload_size}","stored_size":"{header.stored_size}"'
    swapped = f'"stored_size":"{header.stored_size}","payload_size":"{header.payload_size}"'
    reordered = body.replace(sizes.encode(), swapped.encode())
    assert reordered != body and len(reordered) == len(body)
    monkeypatch.setattr(template_module, "_KNOWN_TEMPLATES", {})
    foreign = bytes(raw[:8]) + reordered + b" " * (len(raw) - 8 - len(reordered))
    assert read_header(foreign + bytes(chunk[header.data_offset :])).key == header.key
    assert not template_module._KNOWN_TEMPLATES
    assert len(template_module._UNLEARNABLE) == 1


@settings(max_examples=50, deadline=None)
@given(kv_specs(), st.integers(0, 2**31), st.booleans())
def test_a_chunks_chain_link_is_what_its_key_hashes(spec: KVSpec, seed: int, zstd: bool) -> None:
    """``chain_link`` gives the parent digest and token bytes, by position for a known
    header and through the JSON parser for any other; BLAKE3 of it is the key."""
    import blake3

    kwargs = {"compression": "zstd"} if zstd else {}
    data, _, tokens, key, root = _encode(ChunkLayout(spec), seed, **kwargs)
    link = chain_link(data)
    assert link == root + tokens.astype("<u4").tobytes()
    assert blake3.blake3(link).digest() == key
    saved = dict(template_module._KNOWN_TEMPLATES)
    template_module._KNOWN_TEMPLATES.clear()
    try:
        assert chain_link(data) == link
    finally:
        template_module._KNOWN_TEMPLATES.clear()
        template_module._KNOWN_TEMPLATES.update(saved)


def test_a_chain_link_of_a_cut_or_damaged_header_is_none() -> None:
    spec = KVSpec.simple("m", num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=8)
    data, *_ = _encode(ChunkLayout(spec), 4)
    end = read_header(data).data_offset
    assert chain_link(data[: end - 1]) is None
    assert chain_link(data[:7]) is None
    assert chain_link(b"\xff" * 64) is None
    damaged = bytearray(data)
    damaged[data.index(b'"parent"') + 12] = ord("G")  # not a hex digit
    assert chain_link(bytes(damaged)) is None
