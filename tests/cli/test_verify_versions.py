"""``verify`` and the store's read path on chunks of a newer minor version (spec/FORMAT.md 2.5).

A 1.1 chunk with a dtype or compression this reader does not know is *unsupported*: a miss,
reported and left where it is. The same thing in a 1.0 chunk cannot be (1.0 has no such dtype
or compression): it is malformed, so corrupt, and quarantined.
"""

from __future__ import annotations

import re

from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import FAILURE
from tests.cli.conftest import GoodStore
from tests.format.strategies import reseal, split_chunk

_DTYPE = re.compile(rb'"dtype":"[A-Z0-9_]+"')


def _rewrite(good: GoodStore, index: int, version: bytes, edit) -> str:
    chunk = good.chunks[index]
    path = good.root / chunk.key.path
    text, stored = split_chunk(path.read_bytes())
    text = text.replace(b'"chunkstore":"1.0"', b'"chunkstore":"' + version + b'"')
    path.write_bytes(reseal(edit(text), stored))
    return chunk.key.hex


def _new_dtype(text: bytes) -> bytes:
    return _DTYPE.sub(b'"dtype":"F8_E8M0"', text)


def _new_compression(text: bytes) -> bytes:
    return text.replace(b'"compression":"none"', b'"compression":"lz4"')


def _new_field(text: bytes) -> bytes:
    return text.replace(b',"checksum":', b',"x_note":"added in 1.1","checksum":')


def test_newer_minor_additions_are_left_alone_and_1_0_ones_quarantined(
    cli, good: GoodStore
) -> None:
    unsupported = {
        _rewrite(good, 0, b"1.1", _new_dtype): "UnknownDType",
        _rewrite(good, 1, b"1.1", _new_compression): "UnknownCompression",
    }
    corrupt = {
        _rewrite(good, 2, b"1.0", _new_dtype): "MalformedHeader",
        _rewrite(good, 3, b"1.0", _new_compression): "MalformedHeader",
    }
    _rewrite(good, 4, b"1.1", _new_field)  # a newer minor's extra field: read normally

    with FsStore(str(good.root)) as store:  # the serving path: a plain miss, nothing moved
        assert store.get(good.chunks[0].key) is None
        assert store.get(good.chunks[4].key) is not None
        assert (good.root / good.chunks[0].key.path).exists()

    result = cli("verify", good.root, "--json")
    assert result.rc == FAILURE
    doc = result.json()
    assert doc["ok"] == 4
    assert {c["key"]: c["problem"].split(":")[0] for c in doc["unsupported"]} == unsupported
    assert {c["key"]: c["problem"].split(":")[0] for c in doc["corrupt"]} == corrupt
    assert {c["action"] for c in doc["corrupt"]} == {"quarantined"}
    for chunk in good.chunks:
        assert (good.root / chunk.key.path).exists() == (chunk.key.hex not in corrupt)


def test_inspect_names_the_reason_a_chunk_is_unsupported(cli, good: GoodStore) -> None:
    expected = {
        _rewrite(good, 0, b"1.1", _new_dtype): "UnknownDType",
        _rewrite(good, 1, b"1.1", _new_compression): "UnknownCompression",
    }
    doc = cli("inspect", good.root, "--json").json()
    assert {c["key"]: c["problem"].split(":")[0] for c in doc["unsupported"]} == expected
