"""Every connector option x {wrong type, out of range, huge, empty}: one line naming the option.

No OverflowError, no traceback text, no echo of a megabyte of input: a mistyped
``kv_connector_extra_config`` fails ``vllm serve`` at start-up with one clear line.
"""

from __future__ import annotations

from typing import Any

import pytest

from chunkstore.errors import ChunkStoreError, ConfigError, StoreError
from chunkstore.format import ChunkLayout
from chunkstore.testing.factories import small_spec
from chunkstore.tiering import ProcessCache
from chunkstore.vllm.config import OPTIONS, parse_config

HUGE_TEXT = "x" * (1 << 20)
HUGE_NUMBER_TEXT = "1" + "0" * 400
BOOLEAN = {
    "wrong type": [5, [], {"a": 1}, None],
    "out of range": ["maybe", "2"],
    "huge": [HUGE_TEXT, 10**400],
    "empty": [""],
}
TEXT = {
    "wrong type": [5, ["a"], {"a": 1}, True],
    "out of range": [],
    "huge": [HUGE_TEXT],
    "empty": [""],
}
COUNT = {
    "wrong type": ["abc", 1.5, True, [256], None],
    "out of range": [0, -16, "-1"],
    "huge": [10**400, "1" * 5000, HUGE_NUMBER_TEXT],
    "empty": [""],
}
CHOICE = {
    "wrong type": [1, ["arc"], None],
    "out of range": ["fifo"],
    "huge": [HUGE_TEXT],
    "empty": [""],
}

CASES: dict[str, dict[str, list[Any]]] = {
    "host_cache": {
        "wrong type": [[1], {"a": 1}, True, None],
        "out of range": [0, -1, "5Q", "-3G"],
        "huge": [HUGE_NUMBER_TEXT, 10**400, float("inf"), float("nan"), "1e400", "2E"],
        "empty": [""],
    },
    "host_policy": CHOICE,
    "tiers": {
        "wrong type": [5, [1], {"a": 1}, True],
        "out of range": [
            "nosuchscheme://x",
            "memory://",
            ["/a", "/a"],
            [f"/t{i}" for i in range(17)],
        ],
        "huge": ["/" + HUGE_TEXT],
        "empty": ["", [""], ["  "]],
    },
    "chunk_tokens": {**COUNT, "out of range": [*COUNT["out of range"], 100]},
    "blocks_per_chunk": COUNT,
    "model_id": TEXT,
    "namespace": TEXT,
    "load": BOOLEAN,
    "save": BOOLEAN,
    "save_decode": BOOLEAN,
    "prefetch_timeout_s": {
        "wrong type": [[1], True, {"s": 1}, None],
        "out of range": [-1, "-5s", "nan", "inf", float("nan"), "7y"],
        "huge": [10**400, HUGE_NUMBER_TEXT, 1e300, float("inf"), "9" * 400 + "w"],
        "empty": [""],
    },
    "verify_host": BOOLEAN,
    "compression": {**CHOICE, "out of range": ["lz4"]},
    "store_options": {
        "wrong type": [5, [], {"/t": 1}, ""],
        "out of range": [{"s3://elsewhere": {}}],
        "huge": [{HUGE_TEXT: {}}],
        "empty": [None],
    },
    "shared_pool": TEXT,
    "node": {
        "wrong type": [5, ["/run/n.sock"], {"a": 1}, True],
        "out of range": ["tcp://127.0.0.1:5555", "relative/n.sock", "unix://rel/n.sock"],
        "huge": ["/" + HUGE_TEXT, "unix://" + HUGE_TEXT],
        "empty": [""],
    },
    "metrics_port": {
        "wrong type": ["9100", 1.5, True, [9100]],
        "out of range": [70000, -1],
        "huge": [10**400],
        "empty": [""],
    },
}


def _params() -> list[Any]:
    out = []
    for option, kinds in CASES.items():
        for kind, values in kinds.items():
            for i, value in enumerate(values):
                out.append(pytest.param(option, value, id=f"{option}-{kind}-{i}"))
    return out


def test_the_table_covers_every_option() -> None:
    assert set(CASES) == set(OPTIONS)
    for option, kinds in CASES.items():
        assert set(kinds) == {"wrong type", "out of range", "huge", "empty"}, option


def assert_one_line_naming(exc: BaseException, option: str) -> None:
    message = str(exc)
    assert message.startswith(f"{option}:"), message[:200]
    assert "\n" not in message and "Traceback" not in message
    assert len(message) < 400, message[:200]  # the hostile value is not echoed in full


@pytest.mark.parametrize(("option", "value"), _params())
def test_bad_value_is_one_line_naming_the_option(option: str, value: Any) -> None:
    extra = {option: value}
    if option == "store_options" and isinstance(value, dict):
        extra["tiers"] = ["/kv"]
    with pytest.raises(ConfigError) as exc:
        parse_config(extra, block_size=16)
    assert_one_line_naming(exc.value, option)


def test_unknown_option_names_are_not_echoed_in_full() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({HUGE_TEXT: 1}, block_size=16)
    assert "\n" not in str(exc.value) and len(str(exc.value)) < 400


def test_valid_values_still_parse() -> None:
    cfg = parse_config(
        {"prefetch_timeout_s": "30s", "host_cache": "1T", "tiers": []},
        block_size=16,
    )
    assert cfg.prefetch_timeout_s == 30.0 and cfg.host_cache_bytes == 1 << 40


def test_tier_missing_its_extra_names_the_option() -> None:
    from chunkstore.errors import MissingDependency

    with pytest.raises(MissingDependency) as exc:
        parse_config({"tiers": ["gcs://bucket/kv"]}, block_size=16)  # gcsfs is not installed
    assert_one_line_naming(exc.value, "tiers")
    assert "gcs://bucket/kv" in str(exc.value) and "gcsfs" in str(exc.value)


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1:9/kv", "ftp://no-such-host.invalid/kv"], ids=["refused", "no-host"]
)
def test_unreachable_tier_at_start_up_is_one_line_naming_option_and_url(url: str) -> None:
    cfg = parse_config({"tiers": [url]}, block_size=16)  # a known scheme: parses
    with pytest.raises(ChunkStoreError) as exc:
        ProcessCache(host_bytes=1 << 20, layout=ChunkLayout(small_spec()), tiers=cfg.tiers)
    assert isinstance(exc.value, StoreError)
    assert_one_line_naming(exc.value, "tiers")
    assert url in str(exc.value)
