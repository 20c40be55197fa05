"""One-line errors and documented exit codes for every way a command can be misused."""

from __future__ import annotations

import os
import stat

import pytest

from chunkstore.cli.exitcodes import (
    BAD_CHUNK,
    EXIT_CODES_HELP,
    MISSING_EXTRA,
    STORE_UNAVAILABLE,
    USAGE,
)
from tests.cli.conftest import extract

READ_COMMANDS = (["ls"], ["inspect"], ["verify"], ["prune", "--max-bytes", "1G"])


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("command", READ_COMMANDS)
def test_missing_directory(cli, tmp_path, command) -> None:
    target = tmp_path / "absent"
    result = cli(command[0], target, *command[1:])
    assert result.rc == STORE_UNAVAILABLE
    assert (
        _one_line(result.err)
        == f"chunkstore {command[0]}: error: no such store directory: {target}"
    )
    assert not target.exists()  # never created by a read command


@pytest.mark.parametrize("command", READ_COMMANDS)
def test_not_a_chunkstore_directory(cli, tmp_path, command) -> None:
    base = extract("not-a-store.tar.gz", tmp_path)
    result = cli(command[0], base / "dir", *command[1:])
    assert result.rc == STORE_UNAVAILABLE
    assert "not a chunkstore directory" in _one_line(result.err)
    assert sorted(p.name for p in (base / "dir").iterdir()) == ["notes", "photo.jpg"]


def test_future_layout_is_refused_with_upgrade_hint(cli, tmp_path) -> None:
    base = extract("future-layout.tar.gz", tmp_path)
    result = cli("ls", base / "store")
    assert result.rc == STORE_UNAVAILABLE
    assert "layout 2 is not supported" in _one_line(result.err) and "upgrade" in result.err


def test_a_file_is_not_a_store(cli, tmp_path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    result = cli("ls", path)
    assert result.rc == STORE_UNAVAILABLE and "it is a file" in _one_line(result.err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every directory")
def test_unreadable_directory(cli, good) -> None:
    os.chmod(good.root, 0)
    try:
        result = cli("ls", good.root)
    finally:
        os.chmod(good.root, stat.S_IRWXU)
    assert result.rc == STORE_UNAVAILABLE and "permission denied" in _one_line(result.err)


def test_unreadable_directory_check(cli, good, monkeypatch) -> None:
    # As root the permission bits do not stop reads; the check itself still must say so.
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda p, m: False if str(p) == str(good.root) else real_access(p, m)
    )
    result = cli("ls", good.root)
    assert result.rc == STORE_UNAVAILABLE
    assert _one_line(result.err).endswith(
        f"cannot read store directory {good.root}: permission denied"
    )


def test_missing_extra(cli, monkeypatch) -> None:
    # an fsspec protocol whose package is not installed here
    result = cli("ls", "gcs://bucket/kv")
    assert result.rc == MISSING_EXTRA and "gcsfs" in _one_line(result.err)


def test_unknown_scheme_is_a_usage_error(cli) -> None:
    result = cli("ls", "nosuchproto://x/y")
    assert result.rc == USAGE and _one_line(result.err).startswith("chunkstore ls: error:")


def test_bad_store_option(cli, good) -> None:
    unknown = cli("ls", good.root, "-o", "colour=blue")
    assert unknown.rc == USAGE and "colour" in _one_line(unknown.err)
    malformed = cli("ls", good.root, "-o", "novalue")
    assert malformed.rc == USAGE and "KEY=VALUE" in _one_line(malformed.err)


def test_store_options_from_config_file(cli, good, tmp_path) -> None:
    config = tmp_path / "store.json"
    config.write_text('{"colour": "blue"}')
    assert cli("ls", good.root, "--config", config).rc == USAGE
    config.write_text('{"access_resolution": 5}')
    assert cli("ls", good.root, "--config", config, "--json").json()["count"] == 8
    assert cli("ls", good.root, "--config", tmp_path / "missing.json").rc == USAGE


def test_bad_namespace_argument(cli, good) -> None:
    result = cli("verify", good.root, "--namespace", "XYZ")
    assert result.rc == USAGE and "16 lower-case hex digits" in result.err


def test_show_non_chunk_file(cli, tmp_path) -> None:
    path = tmp_path / "x.kvc"
    path.write_bytes(b"hello world, definitely not a chunk")
    result = cli("show", path)
    assert result.rc == BAD_CHUNK and "not a chunkstore chunk" in _one_line(result.err)


def test_help_documents_exit_codes(cli) -> None:
    result = cli("--help")
    assert result.rc == 0 and EXIT_CODES_HELP.strip() in result.out
    for code in ("0", "1", "2", "3", "4", "5"):
        assert f"\n  {code}  " in result.out


@pytest.mark.parametrize("command", ["ls", "inspect", "show", "verify", "prune", "cp"])
def test_every_command_has_help_and_json(cli, command) -> None:
    result = cli(command, "--help")
    assert result.rc == 0
    assert "--json" in result.out and "examples:" in result.out
