"""The tiering layer: what sits between host memory and the stores.

* :class:`TieredStore`: a host cache in front of secondary stores, as one
  :class:`~chunkstore.backends.Store`. It does write-behind, promotion, prefetch
  and tier fail-over.
* :class:`TierList`: the ordered, guarded tiers. It has the one read loop and
  the one write fan-out. ``TieredStore`` uses it. So does an engine's own
  tier, such as the vLLM native tier.
* :class:`GuardedTier`: one tier's calls, with a timeout and a back-off.
* :class:`ChunkBuffers`: reusable page-aligned chunk buffers for an engine
  tier's jobs. They use huge pages where the kernel offers them.
* :class:`EngineCache`: what an engine's workers save into and load from.
  :class:`ProcessCache` is this process's host cache in front of the tiers.
  :class:`RankCache` is a TP rank's part of a shared host pool.

An engine adapter needs only this layer and :mod:`chunkstore.cache`.
"""

from typing import TYPE_CHECKING

from chunkstore import _lazy

if TYPE_CHECKING:
    from chunkstore.tiering._buffers import ChunkBuffers
    from chunkstore.tiering._engine import (
        ChunkIdentity,
        EngineCache,
        PlainBuffer,
        PrefetchResult,
        ProcessCache,
        RankCache,
        SaveSlot,
        seal_save,
        tier_open_options,
    )
    from chunkstore.tiering._guard import GuardedCall, GuardedTier, TierUnavailable
    from chunkstore.tiering._tiered import TieredHealth, TieredStats, TieredStore, TierStats
    from chunkstore.tiering._tierlist import TierList, TierRead, TierWrites

# The tiered store pulls in numpy, the backends and prometheus_client. So it loads on first
# use, as the host cache does.
_LAZY = {
    **{
        name: "chunkstore.tiering._engine"
        for name in (
            "ChunkIdentity",
            "EngineCache",
            "PlainBuffer",
            "PrefetchResult",
            "ProcessCache",
            "RankCache",
            "SaveSlot",
            "seal_save",
            "tier_open_options",
        )
    },
    "ChunkBuffers": "chunkstore.tiering._buffers",
    "TierList": "chunkstore.tiering._tierlist",
    "TierRead": "chunkstore.tiering._tierlist",
    "TierWrites": "chunkstore.tiering._tierlist",
    "GuardedCall": "chunkstore.tiering._guard",
    "GuardedTier": "chunkstore.tiering._guard",
    "TierUnavailable": "chunkstore.tiering._guard",
    "TieredHealth": "chunkstore.tiering._tiered",
    "TieredStats": "chunkstore.tiering._tiered",
    "TieredStore": "chunkstore.tiering._tiered",
    "TierStats": "chunkstore.tiering._tiered",
}


def __getattr__(name: str) -> object:
    return _lazy.lazy_attribute(__name__, _LAZY, name)


__all__ = [
    "ChunkBuffers",
    "ChunkIdentity",
    "EngineCache",
    "GuardedCall",
    "GuardedTier",
    "PlainBuffer",
    "PrefetchResult",
    "ProcessCache",
    "RankCache",
    "SaveSlot",
    "TierList",
    "TierRead",
    "TierStats",
    "TierUnavailable",
    "TierWrites",
    "TieredHealth",
    "TieredStats",
    "TieredStore",
    "seal_save",
    "tier_open_options",
]
