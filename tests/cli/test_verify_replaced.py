"""``chunkstore verify`` on a live store: a corrupt chunk that a writer replaces with a good
one while verify is checking it is left alone (review #9)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._fsio import LocalIO
from chunkstore.cli.exitcodes import FAILURE
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

CHUNK, OTHER = sample_chunks(2, seed=47)


@pytest.mark.parametrize("action", ["--quarantine", "--delete"])
def test_verify_leaves_a_chunk_rewritten_while_checking(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    root = tmp_path / "s"
    writer = FsStore(str(root), create=True)
    writer.put(CHUNK.key, corrupt_copies(CHUNK)["bitflip"])
    writer.put(OTHER.key, corrupt_copies(OTHER)["bitflip"])
    target = writer.path_of(CHUNK.key)
    real = LocalIO.read

    def read_then_rewrite(self: LocalIO, path: str) -> Any:
        got = real(self, path)
        if path == target:  # verify now holds the corrupt bytes; a writer repairs the chunk
            writer.put(CHUNK.key, CHUNK.data)
        return got

    monkeypatch.setattr(LocalIO, "read", read_then_rewrite)
    result = cli("verify", root, action, "--json")
    assert result.rc == FAILURE
    actions = {c["key"]: c["action"] for c in result.json()["corrupt"]}
    assert actions == {
        CHUNK.key.hex: "left (changed while checking)",
        OTHER.key.hex: "quarantined" if action == "--quarantine" else "deleted",
    }
    monkeypatch.undo()
    assert bytes(writer.get(CHUNK.key) or b"") == CHUNK.data  # the good rewrite survived
    assert not os.path.exists(writer.path_of(OTHER.key))  # the unchanged bad one went
    assert [Path(q.path).name for q in writer.quarantined()] == (
        [f"{OTHER.key.hex}.kvc"] if action == "--quarantine" else []
    )
