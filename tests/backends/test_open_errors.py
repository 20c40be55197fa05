"""URLs checked before anything opens; every open failure one line naming the URL (and option)."""

from __future__ import annotations

from typing import Any

import pytest

from chunkstore.backends._registry import check_url, naming_option, open_for_option, open_store
from chunkstore.errors import ConfigError, MissingDependency, StoreError


@pytest.mark.parametrize(
    "url",
    [
        "/mnt/kv",
        "relative/dir",
        "file:///mnt/kv",
        "s3://bucket/prefix",
        "peer://h:5555",
        "ftp://h/kv",
    ],
)
def test_known_schemes_pass_without_opening(url: str) -> None:
    check_url(url, in_process=False)


@pytest.mark.parametrize(
    ("url", "error", "says"),
    [
        ("", ConfigError, "non-empty"),
        ("   ", ConfigError, "non-empty"),
        (5, ConfigError, "non-empty"),
        (None, ConfigError, "non-empty"),
        ("nosuchscheme://x/kv", ConfigError, "unknown URL scheme nosuchscheme://"),
        ("simplecache::nosuchscheme://x", ConfigError, "unknown URL scheme"),
        ("memory://", ConfigError, "inside one process"),
        ("gcs://bucket/kv", MissingDependency, "gcsfs"),
    ],
)
def test_bad_urls_are_refused_before_opening(url: Any, error: type, says: str) -> None:
    with pytest.raises(error) as exc:
        check_url(url, in_process=False)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_memory_is_fine_inside_one_process() -> None:
    check_url("memory://")
    open_store("memory://").close()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://127.0.0.1:9/kv", "ConnectionRefusedError"),
        ("ftp://no-such-host.invalid/kv", "gaierror"),
    ],
)
def test_unreachable_endpoint_is_a_one_line_store_error(url: str, says: str) -> None:
    with pytest.raises(StoreError) as exc:
        open_store(url)
    message = str(exc.value)
    assert message.startswith(f"cannot open {url}: {says}") and "\n" not in message
    with pytest.raises(StoreError) as named:
        open_for_option("tiers", url)
    assert str(named.value) == f"tiers: {message}"


def test_a_rejected_option_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="bad store option for memory://"):
        open_store("memory://", colour="blue")


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("nosuchscheme://x", ConfigError),
        ("memory://", ConfigError),
        ("gcs://b/k", MissingDependency),
    ],
)
def test_open_for_option_names_option_and_url(url: str, error: type) -> None:
    with pytest.raises(error) as exc:
        open_for_option("tiers", url)
    assert str(exc.value).startswith("tiers: ") and url in str(exc.value)


def test_naming_option_adds_the_url_only_when_missing() -> None:
    assert str(naming_option(StoreError("no such bucket"), "tiers", "s3://b")) == (
        "tiers: s3://b: no such bucket"
    )
    assert (
        str(naming_option(StoreError("s3://b: gone"), "tiers", "s3://b")) == "tiers: s3://b: gone"
    )
    assert isinstance(naming_option(MissingDependency("x"), "o", "u"), MissingDependency)
    assert isinstance(naming_option(ConfigError("x"), "o", "u"), ConfigError)


def test_s3_without_its_extra_is_refused_at_parse_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from chunkstore.vllm.config import parse_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "s3fs" else real(name, *a)
    )
    with pytest.raises(MissingDependency, match=r"s3://bucket/kv needs s3fs.*chunkstore\[s3\]"):
        check_url("s3://bucket/kv")
    with pytest.raises(MissingDependency) as exc:
        parse_config({"tiers": ["s3://bucket/kv"]}, block_size=16)
    assert str(exc.value).startswith("tiers: s3://bucket/kv needs s3fs")
