"""chunkstore as a secondary tier of vLLM 0.33's own ``OffloadingConnector``.

Add ``{"type": "ChunkStoreTier", "module_path": "chunkstore.vllm.native", "tiers": [...]}``
to ``TieringOffloadingSpec``'s ``secondary_tiers``. The class subclasses vLLM's
``SecondaryTierManager``. It loads on first access. If this vLLM has no tiering, that
access raises :class:`~chunkstore.errors.MissingDependency` with an install hint.
"""

from __future__ import annotations

from typing import Any

from chunkstore.errors import MissingDependency

__all__ = ["ChunkStoreTier"]


def __getattr__(name: str) -> Any:
    if name == "ChunkStoreTier":
        try:
            from chunkstore.vllm.native.tier import ChunkStoreTier
        except ImportError as exc:
            if isinstance(exc, MissingDependency) or not (exc.name or "").startswith(
                ("vllm", "torch")
            ):
                raise
            raise MissingDependency(
                "ChunkStoreTier needs vLLM 0.33's offloading tiers: pip install 'vllm>=0.33,<0.34'"
            ) from None
        return ChunkStoreTier
    raise AttributeError(f"module 'chunkstore.vllm.native' has no attribute {name!r}")
