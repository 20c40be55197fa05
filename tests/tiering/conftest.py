"""Fixtures of the tiering tests: the cache tests' layout, chunks and metrics registry."""

from __future__ import annotations

from tests.cache.conftest import chain, layout, metrics

__all__ = ["chain", "layout", "metrics"]
