"""The curated public API: the top-level names, lazy stores and caches, the layer-kind enum."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import chunkstore
from chunkstore.errors import ConfigError
from chunkstore.format import ATTENTION, KINDS, LayerGroup, LayerKind

TOP_LEVEL = {
    "ChunkKey",
    "ChunkLayout",
    "ChunkStoreError",
    "FormatError",
    "HostCache",
    "KVSpec",
    "LayerGroup",
    "LayerKind",
    "Store",
    "TieredStore",
    "__version__",
    "chain_keys",
    "decode_chunk",
    "encode_chunk",
    "namespace_root",
    "open_store",
}


def test_the_top_level_names_are_the_curated_ones_and_all_resolve() -> None:
    assert set(chunkstore.__all__) == TOP_LEVEL
    for name in TOP_LEVEL:
        assert getattr(chunkstore, name) is not None
    assert chunkstore.Store is importlib.import_module("chunkstore.backends.base").Store
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        chunkstore.nothing  # noqa: B018


@pytest.mark.parametrize(
    "package",
    ["chunkstore.format", "chunkstore.hashing", "chunkstore.backends", "chunkstore.cache"],
)
def test_every_subpackage_export_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_import_chunkstore_loads_no_store_or_cache() -> None:
    code = (
        "import sys, chunkstore; "
        "print([m for m in ('fsspec', 'numpy', 'chunkstore.backends', 'chunkstore.cache', "
        "'chunkstore.format') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_layer_kinds_are_an_enum_whose_values_the_spec_uses() -> None:
    group = LayerGroup("mla", (0, 1), 1, 64)
    assert group.kind is LayerKind.MLA and group.kind == "mla"
    assert f"{group.kind}" == "mla"
    assert json.loads(json.dumps(group.to_dict()))["kind"] == "mla"
    assert LayerGroup(LayerKind.ATTENTION, (0,), 2, 4) == LayerGroup("attention", (0,), 2, 4)
    assert ATTENTION is LayerKind.ATTENTION and KINDS == tuple(LayerKind)
    with pytest.raises(ConfigError, match="one of .*'attention'.*got 'conv'"):
        LayerGroup("conv", (0,), 1, 4)
