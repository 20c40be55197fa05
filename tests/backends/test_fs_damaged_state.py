"""A store whose own small files are damaged: the layout marker, the capacity ledger and
access records. Each gives a clear StoreError (or is recounted / ignored), never another
exception and never a hang."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._layout import parse_access
from chunkstore.cli.main import main
from chunkstore.errors import StoreError
from chunkstore.testing.factories import sample_chunks
from tests.cli.conftest import run_process

CHUNKS = sample_chunks(2, seed=41)


@pytest.mark.parametrize(
    "text",
    [b'{"layout": 1e999}', b"[" * 100_000 + b"]" * 100_000, b'{"layout": 1.5}', b"[1]"],
    ids=["infinite", "nested", "fraction", "list"],
)
def test_damaged_marker_is_a_store_error(tmp_path: Path, text: bytes) -> None:
    (tmp_path / "chunkstore-layout.json").write_bytes(text)
    with pytest.raises(StoreError, match="not a chunkstore layout marker"):
        FsStore(str(tmp_path))


def test_fifo_in_place_of_the_marker_is_refused_not_waited_on(tmp_path: Path) -> None:
    """open() of a FIFO blocks until a writer comes: `chunkstore ls` hung forever."""
    os.mkfifo(tmp_path / "chunkstore-layout.json")
    with pytest.raises(StoreError, match="not a regular file"):
        FsStore(str(tmp_path))
    proc = run_process("ls", tmp_path)
    assert proc.returncode == 4
    assert proc.stderr.count("\n") == 1 and "not a regular file" in proc.stderr


def test_fifo_in_place_of_an_access_record_counts_as_no_record(tmp_path: Path) -> None:
    """Spec 6.5: an unreadable record counts as 0; a capped writer's eviction probe and the
    listing must not wait on it."""
    store = FsStore(str(tmp_path), create=True, max_bytes=len(CHUNKS[0].data))
    store.put(CHUNKS[0].key, CHUNKS[0].data)
    os.mkfifo(store.path_of(CHUNKS[0].key) + ".atime")
    assert [i.key for i in store.list()] == [CHUNKS[0].key]
    assert store.put(CHUNKS[1].key, CHUNKS[1].data) is True  # evicts chunk 0, reading its record
    assert [i.key for i in store.list()] == [CHUNKS[1].key]


def test_huge_marker_is_refused_without_being_read(tmp_path: Path) -> None:
    """A (sparse) 64 MiB file at the marker's name: refused at its size, not read whole."""
    with open(tmp_path / "chunkstore-layout.json", "wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(StoreError, match="larger than 1048576 bytes"):
        FsStore(str(tmp_path))


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        (b"1764000000.123", True),
        (b" 1764000000\n", True),
        (b"inf", False),
        (b"1e300", False),
        (b"nan", False),
        (b"-5", False),
        (b"0x10", False),
        (b"\xff", False),
        (b"", False),
    ],
)
def test_access_record_counts_only_as_decimal_seconds(text: bytes, counts: bool) -> None:
    """Spec 6.5: the record is ASCII decimal seconds; anything else counts as 0."""
    assert (parse_access(text) > 0) is counts


def test_damaged_access_record_does_not_pin_its_chunk(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    month_ago = time.time() - 30 * 86400
    for chunk in CHUNKS:
        store.put(chunk.key, chunk.data)
        os.utime(store.path_of(chunk.key), (month_ago, month_ago))
    Path(store.path_of(CHUNKS[0].key) + ".atime").write_text("inf")
    assert main(["prune", str(tmp_path), "--older-than", "7d", "--quiet"]) == 0
    assert list(store.list()) == []
