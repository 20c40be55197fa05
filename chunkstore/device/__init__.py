"""Torch copiers that move chunk payloads between device memory and host buffers.

:func:`select_copier` picks a :class:`DeviceCopier` from the KV cache's device.
CPU gets a :class:`HostCopier` and CUDA a :class:`CudaCopier`. Any other
device gets an :class:`ImageCopier`. :class:`ShardMap` says which bytes of each
chunk a tensor-parallel rank holds. Nothing here serves one engine alone. An
adapter converts its own KV layout and hands the copiers canonical tensors.
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
