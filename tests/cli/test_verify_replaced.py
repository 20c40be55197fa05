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


@pytest.mark.parametrize("action", ["--quarantine", "--delete"])
def test_verify_on_s3_leaves_an_object_rewritten_while_checking(
    cli: Any,
    s3_endpoint: str,
    s3_bucket: str,
    s3_admin: Any,
    monkeypatch: pytest.MonkeyPatch,
    action: str,
) -> None:
    """The same on S3: verify read the damaged object, a writer put a good one in its place,
    and the set-aside (conditional on the ETag that was read) leaves the good one."""
    from chunkstore.backends._s3 import S3Store

    writer = S3Store(s3_bucket, "kv", endpoint_url=s3_endpoint)
    writer.put(CHUNK.key, corrupt_copies(CHUNK)["bitflip"])
    writer.put(OTHER.key, corrupt_copies(OTHER)["bitflip"])
    target = writer.object_key(CHUNK.key)
    real = S3Store._attempt
    rewritten: list[str] = []

    async def read_then_rewrite(self: S3Store, op: str, kwargs: dict[str, Any]) -> Any:
        got = await real(self, op, kwargs)
        if op == "get_object" and kwargs["Key"] == target and not rewritten:
            # verify now holds the corrupt bytes; a writer repairs the chunk (a plain boto3
            # client: a store's calls cannot run inside its own event loop)
            rewritten.append(target)
            s3_admin.put_object(Bucket=s3_bucket, Key=target, Body=CHUNK.data)
        return got

    monkeypatch.setattr(S3Store, "_attempt", read_then_rewrite)
    result = cli(
        "verify", f"s3://{s3_bucket}/kv", "-o", f"endpoint_url={s3_endpoint}", action, "--json"
    )
    monkeypatch.undo()
    assert result.rc == FAILURE and rewritten == [target]
    actions = {c["key"]: c["action"] for c in result.json()["corrupt"]}
    assert actions == {
        CHUNK.key.hex: "left (changed while checking)",
        OTHER.key.hex: "quarantined" if action == "--quarantine" else "deleted",
    }
    assert writer.get(CHUNK.key) == CHUNK.data  # the good rewrite survived
    assert writer.exists(OTHER.key) is False  # the unchanged bad one went
    assert [q.path.rsplit("/", 1)[-1] for q in writer.quarantined()] == (
        [f"{OTHER.key.hex}.kvc"] if action == "--quarantine" else []
    )
    writer.close()
