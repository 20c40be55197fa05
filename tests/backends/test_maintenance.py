"""The maintenance protocols: which stores have them, and what their public quarantine does."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._memory import MemoryStore
from chunkstore.backends.maintenance import SupportsCheckedRemoval, SupportsMaintenance
from chunkstore.testing.factories import sample_chunks

CHUNKS = sample_chunks(2)


def test_fs_store_has_both_protocols_and_memory_neither(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    assert isinstance(store, SupportsMaintenance) and isinstance(store, SupportsCheckedRemoval)
    memory = MemoryStore()
    assert not isinstance(memory, SupportsMaintenance)
    assert not isinstance(memory, SupportsCheckedRemoval)


def test_fs_quarantine_moves_a_chunk_aside_with_its_reason(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True)
    chunk = CHUNKS[0]
    store.put(chunk.key, chunk.data)
    store.quarantine(chunk.key, "KeyMismatch: judged by a tool")
    moved = tmp_path / "quarantine" / chunk.key.namespace / f"{chunk.key.hex}.kvc"
    assert moved.read_bytes() == bytes(chunk.data)
    assert Path(f"{moved}.reason").read_text().endswith(" KeyMismatch: judged by a tool\n")
    assert store.exists(chunk.key) is False
    [held] = store.quarantined()
    assert store.relative_path(held.path) == f"quarantine/{chunk.key.namespace}/{moved.name}"


def test_fs_quarantine_in_delete_mode_deletes(tmp_path: Path) -> None:
    store = FsStore(str(tmp_path), create=True, quarantine="delete")
    chunk = CHUNKS[1]
    store.put(chunk.key, chunk.data)
    store.quarantine(chunk.key, "ChecksumMismatch: bad")
    assert store.exists(chunk.key) is False and store.quarantined() == []


def test_s3_store_has_both_protocols(s3_endpoint: str, s3_bucket: str) -> None:
    pytest.importorskip("s3fs")
    from chunkstore.backends._s3 import S3Store

    store = S3Store(s3_bucket, "p", endpoint_url=s3_endpoint, backoff=0.001)
    try:
        assert isinstance(store, SupportsMaintenance) and isinstance(store, SupportsCheckedRemoval)
        chunk = CHUNKS[0]
        store.put(chunk.key, chunk.data)
        store.quarantine(chunk.key, "ChecksumMismatch: judged by a tool")
        assert store.exists(chunk.key) is False
        [held] = store.quarantined()
        assert store.relative_path(held.path) == (
            f"p/quarantine/{chunk.key.namespace}/{chunk.key.hex}.kvc"
        )
    finally:
        store.close()
