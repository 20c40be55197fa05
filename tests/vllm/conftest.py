"""Fixtures for the vLLM adapter tests: one tiny random model per session."""

from __future__ import annotations

import os

import pytest

from chunkstore.vllm.testing import engine_env

# Before any vllm import: in-process engine, no network.
os.environ.update(engine_env())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    pytest.importorskip("vllm")
    from chunkstore.vllm.testing import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
