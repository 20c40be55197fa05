"""The CLI against an S3 store (moto's server on 127.0.0.1): cp both ways, ls, verify, prune."""

from __future__ import annotations

import uuid

import pytest

from chunkstore.backends._fs import FsStore
from chunkstore.cli.exitcodes import FAILURE, OK, STORE_UNAVAILABLE
from tests.cli.conftest import GoodStore


@pytest.fixture
def endpoint(s3_endpoint: str) -> str:
    return s3_endpoint


@pytest.fixture
def bucket(s3_admin) -> str:
    name = f"cli-{uuid.uuid4().hex[:12]}"
    s3_admin.create_bucket(Bucket=name)
    return name


def test_cp_to_s3_and_back_then_verify_and_prune(cli, good: GoodStore, endpoint, bucket, tmp_path):
    url = f"s3://{bucket}/kv"
    opt = f"endpoint_url={endpoint}"
    up = cli("cp", good.root, url, "--dst-option", opt, "--json")
    assert up.rc == OK and up.json()["copied"] == 8
    again = cli("cp", good.root, url, "--dst-option", opt, "--json").json()
    assert again["copied"] == 0 and again["skipped_existing"] == 8
    listing = cli("ls", url, "-o", opt, "--json").json()
    assert sorted(c["key"] for c in listing["chunks"]) == sorted(c.key.hex for c in good.chunks)

    # damage one object in the bucket, then verify finds and quarantines it
    import boto3

    victim = good.chunks[2]
    data = bytearray(victim.data)
    data[-1] ^= 1
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key=f"kv/{victim.key.path}", Body=bytes(data))
    checked = cli("verify", url, "-o", opt, "--json")
    assert checked.rc == FAILURE
    assert [c["key"] for c in checked.json()["corrupt"]] == [victim.key.hex]
    assert cli("verify", url, "-o", opt).rc == OK

    back = tmp_path / "back"
    down = cli("cp", url, back, "--src-option", opt, "--json").json()
    assert down["copied"] == 7
    assert {i.key.hex for i in FsStore(str(back)).list()} == {
        c.key.hex for c in good.chunks if c is not victim
    }
    pruned = cli("prune", url, "-o", opt, "--max-bytes", "0", "--json").json()
    assert pruned["removed"] == 7
    assert cli("ls", url, "-o", opt, "--json").json()["count"] == 0


def test_missing_bucket_is_one_line(cli, endpoint) -> None:
    result = cli(
        "ls", f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}", "-o", f"endpoint_url={endpoint}"
    )
    assert result.rc == STORE_UNAVAILABLE
    assert len(result.err.strip().splitlines()) == 1 and "does not exist" in result.err


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_an_object_that_cannot_be_read_is_unreadable(
    cli, good: GoodStore, endpoint, bucket, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """A GET (whole, or of the header's range) that fails for good (after retries) is an
    unreadable chunk (exit status 1), not one that vanished: it is still there, unchecked."""
    from botocore.exceptions import ClientError

    from chunkstore.backends._s3 import S3Store

    url = f"s3://{bucket}/kv"
    opt = f"endpoint_url={endpoint}"
    assert cli("cp", good.root, url, "--dst-option", opt).rc == OK
    victim = good.chunks[3]
    real = S3Store._attempt

    async def failing(self: S3Store, op: str, kwargs: dict) -> object:
        if op == "get_object" and kwargs["Key"] == f"kv/{victim.key.path}":
            error = {
                "Error": {"Code": "InternalError"},
                "ResponseMetadata": {"HTTPStatusCode": 500},
            }
            raise ClientError(error, op)
        return await real(self, op, kwargs)

    monkeypatch.setattr(S3Store, "_attempt", failing)
    checked = cli(command, url, "-o", opt, "-o", "max_attempts=1", "--json")
    assert checked.rc == FAILURE
    assert checked.json()["unreadable"] == [
        {"key": victim.key.hex, "namespace": victim.key.namespace}
    ]
    if command == "verify":
        assert checked.json()["vanished"] == 0 and checked.json()["ok"] == 7


@pytest.mark.parametrize("action", ["--quarantine", "--delete"])
def test_verify_without_write_access_says_so(
    cli, good: GoodStore, endpoint, bucket, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """Credentials that may read but not write (an operator's read-only key): the corrupt
    chunk cannot be set aside. verify says that in one line (as on a filesystem it cannot
    write), not that a writer changed the chunk while it was checked."""
    import boto3
    from botocore.exceptions import ClientError

    from chunkstore.backends._s3 import S3Store

    url = f"s3://{bucket}/kv"
    opt = f"endpoint_url={endpoint}"
    assert cli("cp", good.root, url, "--dst-option", opt).rc == OK
    victim = good.chunks[2]
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.put_object(Bucket=bucket, Key=f"kv/{victim.key.path}", Body=victim.data[:-1])
    real = S3Store._attempt

    async def read_only(self: S3Store, op: str, kwargs: dict) -> object:
        if op in ("copy_object", "delete_object", "put_object"):
            error = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
            raise ClientError(error, op)
        return await real(self, op, kwargs)

    monkeypatch.setattr(S3Store, "_attempt", read_only)
    checked = cli("verify", url, "-o", opt, action)
    assert checked.rc == STORE_UNAVAILABLE
    assert "changed while checking" not in checked.out
    assert (
        f"cannot set aside {url}/{victim.key.path}:" in checked.err
        and "AccessDenied" in checked.err
    )
    assert len(checked.err.strip().splitlines()) == 1
