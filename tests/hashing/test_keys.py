"""Chain keys: determinism, input types, namespaces and parsing."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import blake3
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkstore.errors import ConfigError, KeyParseError
from chunkstore.hashing import ChunkKey, chain_keys, encode_extra, namespace_of, namespace_root

FP = bytes(range(32))
ROOT = namespace_root(FP)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 64))
def test_one_key_per_full_chunk_and_prefix_property(tokens: list[int], chunk: int) -> None:
    keys = chain_keys(tokens, root=ROOT, chunk_tokens=chunk)
    assert len(keys) == len(tokens) // chunk
    # a prefix of the tokens yields a prefix of the keys: what makes reuse work
    cut = len(tokens) // 2
    assert chain_keys(tokens[:cut], root=ROOT, chunk_tokens=chunk) == keys[: cut // chunk]


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 64), st.integers(0, 8))
def test_a_chain_goes_on_after_a_key_digest_for_digest(
    tokens: list[int], chunk: int, done: int
) -> None:
    """``after`` extends a chain already computed (as the vLLM scheduler does while a request
    grows): the rest is the whole chain's tail, each key BLAKE3(parent || LE uint32 tokens)."""
    keys = chain_keys(tokens, root=ROOT, chunk_tokens=chunk)
    done = min(done, len(keys))
    after = keys[done - 1] if done else None
    rest = chain_keys(tokens[done * chunk :], root=ROOT, chunk_tokens=chunk, after=after)
    assert rest == keys[done:]
    parent = ROOT if after is None else after.digest
    for i, key in enumerate(rest):
        start = (done + i) * chunk
        link = struct.pack(f"<{chunk}I", *tokens[start : start + chunk])
        parent = blake3.blake3(parent + link).digest()
        assert key == ChunkKey(parent, namespace_of(ROOT))


@given(st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=64))
def test_changing_any_token_changes_that_key_and_all_later(tokens: list[int]) -> None:
    keys = chain_keys(tokens, root=ROOT, chunk_tokens=1)
    changed = list(tokens)
    changed[0] = (changed[0] + 1) % 2**32
    other = chain_keys(changed, root=ROOT, chunk_tokens=1)
    assert all(a != b for a, b in zip(keys, other))


def test_lists_numpy_and_torch_give_the_same_keys() -> None:
    tokens = list(range(1000, 1100))
    expected = chain_keys(tokens, root=ROOT, chunk_tokens=16)
    for array in (
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=">i4"),
    ):
        assert chain_keys(array, root=ROOT, chunk_tokens=16) == expected
    torch = pytest.importorskip("torch")
    assert chain_keys(torch.tensor(tokens), root=ROOT, chunk_tokens=16) == expected


def test_keys_are_identical_across_processes_and_hash_seeds() -> None:
    code = (
        "from chunkstore.hashing import chain_keys, namespace_root;"
        "r = namespace_root(bytes(range(32)), extra={'cache_salt': 's', 'lora': 3});"
        "print(','.join(k.hex for k in chain_keys(list(range(64)), root=r, chunk_tokens=16)))"
    )
    outputs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
    root = namespace_root(FP, extra={"lora": 3, "cache_salt": "s"})
    assert outputs == {
        ",".join(k.hex for k in chain_keys(list(range(64)), root=root, chunk_tokens=16)) + "\n"
    }


def test_salts_models_and_extras_never_share_keys() -> None:
    roots = {
        namespace_root(FP),
        namespace_root(FP, extra={"cache_salt": "a"}),
        namespace_root(FP, extra={"cache_salt": "b"}),
        namespace_root(FP, extra={"lora": "a"}),
        namespace_root(bytes(32)),
        namespace_root(FP, extra={"mm": ["x", "y"]}),
        namespace_root(FP, extra={"mm": ["xy"]}),
    }
    assert len(roots) == 7
    assert namespace_root(FP, extra={"lora": None}) == namespace_root(FP)
    assert namespace_root(FP, extra={"a": 1, "b": 2}) == namespace_root(FP, extra={"b": 2, "a": 1})


def test_keys_print_and_parse_as_lower_case_hex() -> None:
    key = chain_keys(range(16), root=ROOT, chunk_tokens=16)[0]
    assert str(key) == key.hex and key.hex == key.hex.lower() and len(key.hex) == 64
    assert ChunkKey.parse(key.hex, key.namespace) == key
    assert ChunkKey.parse_path("/mnt/kv/" + key.path) == key
    assert key.path.startswith(f"{namespace_of(ROOT)}/{key.hex[:2]}/{key.hex[2:4]}/")
    for bad in (key.hex.upper(), key.hex[:-1], key.hex + "0", "g" * 64, "", 42):
        with pytest.raises(KeyParseError):
            ChunkKey.parse(bad, key.namespace)  # type: ignore[arg-type]
    with pytest.raises(KeyParseError):
        ChunkKey.parse_path(f"{key.namespace}/00/00/{key.hex}.kvc")


def test_bad_inputs_are_clear_errors() -> None:
    with pytest.raises(ConfigError):
        chain_keys([1, 2], root=ROOT, chunk_tokens=0)
    with pytest.raises(ConfigError):
        chain_keys([1, 2], root=b"short", chunk_tokens=1)
    with pytest.raises(ConfigError):
        chain_keys([-1], root=ROOT, chunk_tokens=1)
    with pytest.raises(ConfigError):
        chain_keys([1.5], root=ROOT, chunk_tokens=1)
    with pytest.raises(ConfigError):
        chain_keys([[1, 2]], root=ROOT, chunk_tokens=1)
    with pytest.raises(ConfigError):
        namespace_root(FP, extra={"x": object()})


@pytest.mark.parametrize(
    "extra",
    [
        {"x": 1.5},
        {"x": {"a": "b"}},
        {"mm": ["a", None]},
        {"n": 2**64},
        {"n": -(2**63) - 1},
        {1: "v"},
        {"x": "\ud800"},
        {"\ud800": "x"},
        {"x": np.int64(3)},
    ],
    ids=repr,
)
def test_extra_values_outside_the_closed_set_are_refused(extra: dict) -> None:
    with pytest.raises(ConfigError):
        namespace_root(FP, extra=extra)


def test_extra_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        namespace_root(FP, extra=["a", "b"])  # type: ignore[arg-type]


def test_extra_value_types_encode_as_spec_section_5_2_says() -> None:
    def entry(name: bytes, value: bytes) -> bytes:
        return len(name).to_bytes(4, "little") + name + len(value).to_bytes(8, "little") + value

    assert encode_extra(None) == encode_extra({}) == encode_extra({"lora": None}) == b""
    assert encode_extra({"b": True, "a": -7}) == entry(b"a", b"s-7") + entry(b"b", b"sTrue")
    assert encode_extra({"x": b"\x00"}) == entry(b"x", b"b\x00")
    items = [f"h{i}" for i in range(12)]
    expected = b"".join(entry(str(i).encode(), b"s" + v.encode()) for i, v in enumerate(items))
    assert encode_extra({"mm": items}) == entry(b"mm", b"l" + expected)  # list order, not "10"<"2"
    assert encode_extra({"é": "ü"}) == entry("é".encode(), "sü".encode())
