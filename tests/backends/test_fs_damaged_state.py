"""A store whose own small files are damaged: the layout marker, the capacity ledger and
access records. Each gives a clear StoreError (or is recounted / ignored), never another
exception and never a hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.errors import StoreError


@pytest.mark.parametrize(
    "text",
    [b'{"layout": 1e999}', b"[" * 100_000 + b"]" * 100_000, b'{"layout": 1.5}', b"[1]"],
    ids=["infinite", "nested", "fraction", "list"],
)
def test_damaged_marker_is_a_store_error(tmp_path: Path, text: bytes) -> None:
    (tmp_path / "chunkstore-layout.json").write_bytes(text)
    with pytest.raises(StoreError, match="not a chunkstore layout marker"):
        FsStore(str(tmp_path))
