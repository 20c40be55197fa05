"""Connector options: defaults, sizes, and clear errors naming the bad option."""

from __future__ import annotations

import pytest

from chunkstore.errors import ConfigError
from chunkstore.vllm.config import OPTIONS, parse_config, parse_size


def test_defaults_follow_the_kv_role():
    cfg = parse_config({}, block_size=16)
    assert cfg.chunk_tokens == 256 and cfg.host_cache_bytes == 2 << 30
    assert cfg.load and cfg.save and cfg.tiers == ()
    assert not parse_config({}, block_size=16, kv_role="kv_consumer").save
    assert not parse_config({}, block_size=16, kv_role="kv_producer").load


def test_values_are_parsed():
    cfg = parse_config(
        {
            "host_cache": "1.5G",
            "tiers": "file:///mnt/kv",
            "blocks_per_chunk": 2,
            "save": "false",
            "compression": "ZSTD",
            "prefetch_timeout_s": 0.5,
        },
        block_size=128,
    )
    assert cfg.host_cache_bytes == 3 << 29
    assert cfg.tiers == ("file:///mnt/kv",)
    assert cfg.chunk_tokens == 256 and not cfg.save
    assert cfg.compression == "zstd" and cfg.prefetch_timeout_s == 0.5
    assert cfg.metrics_port is None
    assert parse_config({"metrics_port": 9400}, block_size=16).metrics_port == 9400


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        ({"host_cahce": "8G"}, "host_cahce"),
        ({"host_cache": "lots"}, "host_cache"),
        ({"host_cache": 0}, "host_cache"),
        ({"chunk_tokens": 100}, "chunk_tokens"),
        ({"chunk_tokens": 64, "blocks_per_chunk": 4}, "blocks_per_chunk"),
        ({"blocks_per_chunk": -1}, "blocks_per_chunk"),
        ({"tiers": [1]}, "tiers"),
        ({"tiers": ["/a", "/a"]}, "tiers"),
        ({"host_policy": "fifo"}, "host_policy"),
        ({"save": "maybe"}, "save"),
        ({"prefetch_timeout_s": -1}, "prefetch_timeout_s"),
        ({"compression": "lz4"}, "compression"),
        ({"store_options": {"s3://x": {}}}, "store_options"),
        ({"model_id": ""}, "model_id"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"metrics_port": "9100"}, "metrics_port"),
    ],
)
def test_invalid_options_name_themselves(extra, option):
    with pytest.raises(ConfigError, match=option):
        parse_config(extra, block_size=32)


@pytest.mark.parametrize("extra", ["host_cache=2G", '{"host_cache": "2G"}', ["host_cache"], 8])
def test_extra_config_that_is_not_a_mapping_is_one_error_line(extra):
    with pytest.raises(ConfigError) as info:
        parse_config(extra, block_size=16)
    message = str(info.value)
    assert message.startswith("kv_connector_extra_config: expected a JSON object")
    assert '{"host_cache": "8G"' in message and repr(extra)[:10] in message
    assert "\n" not in message


def test_sizes():
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("8g") == 8 << 30
    assert parse_size(4096) == 4096
    with pytest.raises(ConfigError):
        parse_size(True)


def test_every_option_is_documented():
    assert all(text.strip() for text in OPTIONS.values())


def test_engine_start_fails_on_unknown_option(tiny_model):
    from .harness import make_harness

    with pytest.raises(ConfigError, match="ChunkStoreConnector: unknown .*'tierz'"):
        make_harness(tiny_model, {"tierz": ["/tmp/x"]})


def test_vllm_connector_factory_builds_both_roles(tiny_model):
    """What ``vllm serve --kv-transfer-config`` does: the factory imports and builds the connector
    for the scheduler and for a worker (vLLM 0.32 and 0.33)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from chunkstore.vllm.connector import ChunkStoreConnector

    from .harness import make_harness, shut_down

    h = make_harness(tiny_model)
    made = []
    try:
        config, kv_cache_config = h.scheduler.vllm_config, h.scheduler.kv_cache_config
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            connector = KVConnectorFactory.create_connector(config, role, kv_cache_config)
            made.append(connector)
            assert isinstance(connector, ChunkStoreConnector)
            assert (connector.scheduler is not None) == (role == KVConnectorRole.SCHEDULER)
    finally:
        for connector in made:
            connector.shutdown()
        shut_down(h)


def test_every_native_tier_option_is_documented():
    from pathlib import Path

    from chunkstore.vllm.native.options import TIER_OPTIONS

    root = Path(__file__).resolve().parents[2]
    page = root / "docs" / "vllm.md"  # the manual's vLLM page; README.md before the docs site
    text = (page if page.exists() else root / "README.md").read_text()
    section = text[text.index("### Inside vLLM's own offloading") :]
    missing = sorted(o for o in TIER_OPTIONS if f"`{o}`" not in section)
    assert not missing, f"ChunkStoreTier options missing from README.md: {missing}"
