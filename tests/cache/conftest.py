"""Fixtures of the cache tests: a small layout, its chunks, and a private metrics registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from chunkstore.format import ChunkLayout
from chunkstore.metrics import ChunkstoreMetrics
from chunkstore.testing.factories import MadeChunk, sample_chunks, small_spec

LAYOUT = ChunkLayout(small_spec())
SLOT = 64 * 1024
"""Slot size of the conformance configurations: room for the suite's other layouts too."""


@pytest.fixture
def layout() -> ChunkLayout:
    return LAYOUT


@pytest.fixture
def chain() -> list[MadeChunk]:
    """Twelve chained chunks of the small layout (8 KiB each)."""
    return sample_chunks(12, seed=21, layout=LAYOUT)


@pytest.fixture
def metrics() -> ChunkstoreMetrics:
    return ChunkstoreMetrics(CollectorRegistry())
