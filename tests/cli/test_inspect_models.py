"""``chunkstore inspect`` names the model of each fingerprint from the store's model records."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.backends._memory import MemoryStore
from chunkstore.backends._models import model_of_record, read_model, record_model
from chunkstore.backends._s3 import S3Store
from chunkstore.format import ChunkLayout, read_header
from chunkstore.testing.factories import sample_chunks, small_spec
from tests.cli.conftest import DamagedStore, GoodStore

SPEC = small_spec()  # the spec the `good` store's chunks were made with


def test_a_recorded_model_is_named_beside_its_fingerprint(cli, good: GoodStore) -> None:
    with FsStore(str(good.root)) as store:
        assert record_model(store, SPEC)
        assert not record_model(store, SPEC)  # a valid record is there: left as it is
    fingerprint = SPEC.fingerprint().hex()
    doc = cli("inspect", good.root, "--json").json()
    assert [(m["fingerprint"], m["model_id"]) for m in doc["models"]] == [
        (fingerprint, "test/tiny")
    ]
    table = cli("inspect", good.root).out.splitlines()
    header = next(line for line in table if line.startswith("MODEL FINGERPRINT"))
    assert header.split()[-1] == "MODEL"
    row = next(line for line in table if line.startswith(fingerprint[:16]))
    assert row.split()[1] == "8" and row.split()[-1] == "test/tiny"
    # The record is not a chunk: listings and the foreign-file report do not see it.
    assert doc["chunks"] == 8 and doc["foreign"]["count"] == 0


def test_a_store_without_records_shows_unknown(cli, damaged: DamagedStore) -> None:
    doc = cli("inspect", damaged.root, "--json").json()
    assert doc["models"] and all(m["model_id"] is None for m in doc["models"])
    fp_a = damaged.manifest["fingerprints"]["a"][:16]
    row = next(
        line for line in cli("inspect", damaged.root).out.splitlines() if line.startswith(fp_a)
    )
    assert row.split()[-1] == "unknown"


def test_a_record_that_does_not_hash_to_its_fingerprint_is_ignored(cli, good: GoodStore) -> None:
    other = small_spec(model_id="someone/else")
    with FsStore(str(good.root)) as store:
        store.write_model_record(SPEC.fingerprint(), other.canonical_json())
        assert read_model(store, SPEC.fingerprint()) is None
        assert record_model(store, SPEC)  # replaced by a valid one
        spec = read_model(store, SPEC.fingerprint())
        assert spec is not None and spec.model_id == "test/tiny"
    doc = cli("inspect", good.root, "--json").json()
    assert doc["models"][0]["model_id"] == "test/tiny"


@pytest.mark.parametrize(
    "record",
    [b"", b"not json", b'{"model_id": 1}', SPEC.canonical_json() + b" "],
)
def test_model_of_record_accepts_only_the_canonical_json(record: bytes) -> None:
    assert model_of_record(record, SPEC.fingerprint()) is None
    assert model_of_record(SPEC.canonical_json(), SPEC.fingerprint()) == SPEC


def test_stores_without_records_are_skipped() -> None:
    class Bare(MemoryStore):
        # None hides an inherited method from the runtime protocol check.
        read_model_record = None
        write_model_record = None

    assert not record_model(Bare(), SPEC)
    assert read_model(Bare(), SPEC.fingerprint()) is None


def test_s3_keeps_records_beside_the_chunks(s3_endpoint: str, s3_admin, tmp_path: Path) -> None:
    s3_admin.create_bucket(Bucket="models-test")
    chunks = sample_chunks(2, layout=ChunkLayout(SPEC))
    with S3Store("models-test", "kv", endpoint_url=s3_endpoint, backoff=0.001) as store:
        for chunk in chunks:
            store.put(chunk.key, chunk.data)
        assert record_model(store, SPEC)
        assert read_model(store, SPEC.fingerprint()) == SPEC
        assert len(list(store.list())) == 2 and store.foreign_files() == []
    names = {o["Key"] for o in s3_admin.list_objects_v2(Bucket="models-test")["Contents"]}
    assert f"kv/.chunkstore/models/{SPEC.fingerprint().hex()}.json" in names


def test_cp_carries_the_model_records_along(cli, good: GoodStore, tmp_path: Path) -> None:
    with FsStore(str(good.root)) as store:
        record_model(store, SPEC)
    copy = tmp_path / "copy"
    assert cli("cp", good.root, copy).rc == 0
    with FsStore(str(copy)) as store:
        assert read_model(store, SPEC.fingerprint()) == SPEC
    assert cli("inspect", copy, "--json").json()["models"][0]["model_id"] == "test/tiny"


def test_unreadable_model_record_shows_the_model_as_unknown(tmp_path: Path, cli) -> None:
    """A directory at a model record's name: inspect names the model unknown (no traceback),
    and a writer's record_model is refused quietly (the record is a hint, never the chunks)."""
    store = FsStore(str(tmp_path), create=True)
    chunk = sample_chunks(1)[0]
    store.put(chunk.key, chunk.data)
    fingerprint = read_header(chunk.data).fingerprint
    assert fingerprint == SPEC.fingerprint()
    (tmp_path / ".chunkstore" / "models" / f"{fingerprint.hex()}.json").mkdir(parents=True)
    assert store.read_model_record(fingerprint) is None
    result = cli("inspect", tmp_path, "--json")
    assert result.rc == 0, result.err
    assert [m["model_id"] for m in result.json()["models"]] == [None]
    assert record_model(store, SPEC) is False
