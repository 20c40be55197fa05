"""Huge, infinite and out-of-range numbers and unopenable URLs on the command line.

Each is one line naming the option (or the URL) and the documented exit code:
2 for a bad argument, 3 for a missing extra, 4 for a store that cannot be opened.
Never an OverflowError or a raw socket error with a traceback.
"""

from __future__ import annotations

import pytest

from chunkstore.cli.exitcodes import MISSING_EXTRA, STORE_UNAVAILABLE, USAGE

HUGE = "1" + "0" * 400


def error_line(err: str) -> str:
    """The ``error:`` line of stderr (argparse prints its usage above it)."""
    assert "Traceback" not in err and "OverflowError" not in err, err
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert len(lines[0]) < 400, lines[0][:200]  # the value is not echoed in full
    return lines[0]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["prune", "{store}", "--max-bytes", HUGE], "size"),
        (["prune", "{store}", "--max-bytes", "inf"], "size"),
        (["prune", "{store}", "--older-than", HUGE], "age"),
        (["prune", "{store}", "--older-than", "9" * 400 + "w"], "age"),
        (["prune", "{store}", "--older-than", "nan"], "age"),
        (["verify", "{store}", "--grace", "1e400"], "age"),
        (["serve", "--slot-size", "4KiB", "--host-cache", HUGE], "--host-cache"),
        (["serve", "--slot-size", HUGE], "--slot-size"),
        (["serve", "--slot-size", "4KiB", "--tier-timeout", "1e300"], "--tier-timeout"),
        (["serve", "--slot-size", "4KiB", "--tier-timeout", "nan"], "--tier-timeout"),
        (["serve", "--slot-size", "4KiB", "--retry-after", "1e400"], "--retry-after"),
        (["serve", "--slot-size", "4KiB", "--queue-size", HUGE], "--queue-size"),
        (["serve", "--slot-size", "4KiB", "--metrics-port", HUGE], "--metrics-port"),
        (
            ["serve", "--slot-size", "4KiB", "--peer-port", "0", "--peer-max-lease", "1e300"],
            "--peer-max-lease",
        ),
        (
            ["serve", "--slot-size", "4KiB", "--peer-port", "0", "--peer-heartbeat", "1e300"],
            "--peer-heartbeat",
        ),
        (["serve", "--slot-size", "4KiB", "--peer-port", HUGE], "--peer-port"),
        (["peers", "--peer", "127.0.0.1:9", "--timeout", "1e300"], "--timeout"),
    ],
)
def test_huge_numbers_are_one_line_naming_the_option(cli, good, args, flag) -> None:
    result = cli(*[a.format(store=good.root) for a in args])
    assert result.rc == USAGE
    assert flag in error_line(result.err)


@pytest.mark.parametrize(
    ("url", "rc", "says"),
    [
        ("ftp://127.0.0.1:9/kv", STORE_UNAVAILABLE, "ConnectionRefusedError"),
        ("ftp://no-such-host.invalid/kv", STORE_UNAVAILABLE, "gaierror"),
        ("nosuchscheme://x/kv", USAGE, "unknown URL scheme"),
        ("memory://", USAGE, "inside one process"),
        ("gcs://bucket/kv", MISSING_EXTRA, "gcsfs"),
    ],
)
def test_unopenable_urls_are_one_line_naming_the_url(cli, url, rc, says) -> None:
    result = cli("ls", url)
    assert result.rc == rc
    line = error_line(result.err)
    assert url in line and says in line


def test_serve_names_the_store_flag(cli) -> None:
    result = cli("serve", "--slot-size", "4KiB", "--store", "ftp://127.0.0.1:9/kv")
    assert result.rc == STORE_UNAVAILABLE
    line = error_line(result.err)
    assert "--store" in line and "ftp://127.0.0.1:9/kv" in line
