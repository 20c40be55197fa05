"""The plans the scheduler-side connector sends the workers each step.

The classes are picklable and need no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkstore.hashing import ChunkKey

__all__ = ["ChunkLoad", "ChunkSave", "ChunkStoreMetadata"]


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    """Copy one chunk from host memory into a request's device blocks."""

    req_id: str
    """Request the blocks belong to."""
    key: ChunkKey
    """Chunk to read."""
    block_ids: tuple[tuple[int, ...], ...]
    """Per KV cache group, the chunk's ``blocks_per_chunk`` blocks; 0 is the null block."""
    skip_blocks: int
    """Leading blocks of the chunk already computed on the device, which stay untouched."""
    is_async: bool  # set for hybrid models
    """Whether the load reports through ``get_transfer_results``, not as a sync error."""


@dataclass(frozen=True, slots=True)
class ChunkSave:
    """Copy a request's device blocks into one new chunk."""

    req_id: str
    """Request the blocks belong to."""
    key: ChunkKey
    """Key of the new chunk."""
    parent: bytes
    """Parent digest: the previous chunk's key, or the namespace root for the first chunk."""
    tokens: tuple[int, ...]
    """The ``chunk_tokens`` tokens the chunk covers."""
    block_ids: tuple[tuple[int, ...], ...]
    """Per KV cache group, the chunk's blocks."""


@dataclass
class ChunkStoreMetadata:
    """One step's loads, before the forward pass, and saves, after it.

    :mod:`chunkstore.vllm.connector` registers it as a virtual subclass of
    vLLM's ``KVConnectorMetadata``. This module imports no vLLM.
    """

    loads: list[ChunkLoad] = field(default_factory=list)
    """Chunks to copy host -> device."""
    saves: list[ChunkSave] = field(default_factory=list)
    """Chunks to copy device -> host."""
    async_load_reqs: set[str] = field(default_factory=set)
    """Requests whose loads this step are asynchronous; transfer results complete them."""
