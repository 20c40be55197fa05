"""Chunk payloads between an engine's device memory and host buffers, with torch.

:func:`select_copier` picks a :class:`DeviceCopier` from the KV cache's device:
:class:`HostCopier` on CPU, :class:`CudaCopier` on CUDA (a side stream and events),
:class:`ImageCopier` on any other device. :class:`ShardMap` says which bytes of each
chunk a tensor-parallel rank holds. Nothing here is about one engine: an adapter
converts its own KV layout and hands these copiers the canonical tensors.
"""

from chunkstore.device._copiers import (
    Batch,
    CudaCopier,
    CudaRuntime,
    DeviceCopier,
    Fence,
    HostCopier,
    ImageCopier,
    ShardMap,
    ShardTensor,
    byte_tensor,
    select_copier,
)

__all__ = [
    "Batch",
    "CudaCopier",
    "CudaRuntime",
    "DeviceCopier",
    "Fence",
    "HostCopier",
    "ImageCopier",
    "ShardMap",
    "ShardTensor",
    "byte_tensor",
    "select_copier",
]
