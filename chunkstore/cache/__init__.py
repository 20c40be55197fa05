"""Tier 0: the host-memory chunk cache, its replacement policies, and the tiered store.

* :class:`HostCache` - whole chunks in a preallocated (optionally shared,
  optionally pinned) slot pool, evicted by :class:`PrefixARCPolicy` (default),
  :class:`ARCPolicy` or :class:`LRUPolicy`;
* :class:`TieredStore` - a host cache in front of secondary stores, with
  write-behind, promotion and tier fail-over;
* :class:`SlotPool` - the pool itself, which other processes can attach by name;
* :class:`AssemblyOwner` / :class:`ShardAssembler` - TP rank processes write
  their head shards into one shared slot per chunk, published once.

The policies are pure bookkeeping (no I/O), so the trace simulator
(:mod:`chunkstore.simulator`) replays traces through the very same classes.
"""

from chunkstore.cache.arc import ARCPolicy
from chunkstore.cache.assembly import AssemblerStats, ShardAssembler, ShardClaim, SlotRead
from chunkstore.cache.assembly_owner import AssemblyOwner, AssemblyStats
from chunkstore.cache.host import Adoption, HostCache, HostCacheStats, Lease
from chunkstore.cache.lru import LRUPolicy
from chunkstore.cache.policy import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    CachePolicy,
    NoEvictableEntry,
    make_policy,
)
from chunkstore.cache.pool import SlotPool, StaleSlot
from chunkstore.cache.prefix_arc import PrefixARCPolicy
from chunkstore.cache.tiered import TieredStats, TieredStore, TierStats

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "ARCPolicy",
    "Adoption",
    "AssemblerStats",
    "AssemblyOwner",
    "AssemblyStats",
    "CachePolicy",
    "HostCache",
    "HostCacheStats",
    "LRUPolicy",
    "Lease",
    "NoEvictableEntry",
    "PrefixARCPolicy",
    "ShardAssembler",
    "ShardClaim",
    "SlotPool",
    "SlotRead",
    "StaleSlot",
    "TierStats",
    "TieredStats",
    "TieredStore",
    "make_policy",
]
