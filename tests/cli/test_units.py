"""Sizes and ages as the CLI accepts and prints them."""

from __future__ import annotations

import pytest

from chunkstore.errors import ConfigError
from chunkstore.units import format_age, format_size, parse_age, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("10b", 10),
        ("1k", 1024),
        ("2KiB", 2048),
        ("500G", 500 * 2**30),
        ("500g", 500 * 2**30),
        ("1.5T", int(1.5 * 2**40)),
        (".5G", 2**29),
        ("800MB", 800 * 10**6),
        ("3GB", 3 * 10**9),
        ("1PiB", 2**50),
        (" 64M ", 64 * 2**20),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "G", "ib", "5x", "-1", "1.2.3G", "5 G B", "1e3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30", 30.0),
        ("30s", 30.0),
        ("90m", 5400.0),
        ("12h", 43200.0),
        ("7d", 604800.0),
        ("2w", 1209600.0),
        ("1d12h", 129600.0),
        ("1d 12h", 129600.0),
        ("1.5h", 5400.0),
        ("0d", 0.0),
    ],
)
def test_parse_age(text: str, expected: float) -> None:
    assert parse_age(text) == expected


@pytest.mark.parametrize("text", ["", "d", "7x", "-3", "-3d", "inf", "nan", "7dd", "h7"])
def test_parse_age_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="invalid age"):
        parse_age(text)


def test_format_size() -> None:
    assert [format_size(n) for n in (0, 1023, 1024, 12288, 5 * 2**30, 3 * 2**50, 2**60)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "12.0 KiB",
        "5.0 GiB",
        "3.0 PiB",
        "1024.0 PiB",
    ]


def test_format_age() -> None:
    got = [format_age(s) for s in (-5, 5, 700, 20000, 300000, 10**7, 7200, 2 * 86400, 28 * 86400)]
    assert got == ["0s", "5s", "11m", "5h 33m", "3d 11h", "16w 3d", "2h", "2d", "4w"]
