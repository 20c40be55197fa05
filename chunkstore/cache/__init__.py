"""Tier 0: the host-memory chunk cache and its replacement policies.

* :class:`HostCache` keeps whole chunks in a preallocated slot pool.
  The pool may be shared, and may be pinned.
  :class:`PrefixARCPolicy`, the default, :class:`ARCPolicy` or :class:`LRUPolicy` evicts.
* :class:`SlotPool` is the pool itself, which other processes can attach by name.
* :class:`AssemblyOwner` and :class:`ShardAssembler` run TP shard assembly.
  TP rank processes write their head shards into one shared slot per chunk.
  The chunk is published once. All of it is in :mod:`chunkstore.cache.assembly`.

``__all__`` is the cache as users drive it.
The pool and assembly classes are importable from here too, but not curated.
They are for the vLLM adapter and advanced use.

The policies are pure bookkeeping with no I/O.
So the trace simulator, :mod:`chunkstore.simulator`, replays traces through the same classes.
The tiered store, a host cache in front of secondary stores, is one layer up.
See :mod:`chunkstore.tiering`.
"""

from typing import TYPE_CHECKING

from chunkstore import _lazy
from chunkstore.cache.policy import DEFAULT_POLICY, POLICY_NAMES, CachePolicy, make_policy

# isort: split
from chunkstore.cache.policy import NoEvictableEntry as NoEvictableEntry

if TYPE_CHECKING:
    from chunkstore.cache._arc import ARCPolicy
    from chunkstore.cache._host import HostCache, HostCacheStats
    from chunkstore.cache._lease import Lease
    from chunkstore.cache._lru import LRUPolicy
    from chunkstore.cache._prefix_arc import PrefixARCPolicy

    # isort: split
    # Importable here, not curated: the shared pool and TP assembly the vLLM adapter builds on.
    from chunkstore.cache._host import Adoption as Adoption
    from chunkstore.cache._pool import SlotPool as SlotPool
    from chunkstore.cache._pool import StaleSlot as StaleSlot
    from chunkstore.cache.assembly import AssemblyOwner as AssemblyOwner
    from chunkstore.cache.assembly import AssemblyOwnerStats as AssemblyOwnerStats
    from chunkstore.cache.assembly import ShardAssembler as ShardAssembler
    from chunkstore.cache.assembly import ShardAssemblerStats as ShardAssemblerStats

# Note: the host cache and its pool pull in numpy and prometheus_client. They load on first
# use, as do the policy classes (make_policy imports them itself): `chunkstore --help`
# reads POLICY_NAMES at the cost of policy.py alone.
_LAZY = {
    "ARCPolicy": "chunkstore.cache._arc",
    "LRUPolicy": "chunkstore.cache._lru",
    "PrefixARCPolicy": "chunkstore.cache._prefix_arc",
    "HostCache": "chunkstore.cache._host",
    "HostCacheStats": "chunkstore.cache._host",
    "Adoption": "chunkstore.cache._host",
    "Lease": "chunkstore.cache._lease",
    "ShardAssembler": "chunkstore.cache.assembly",
    "ShardAssemblerStats": "chunkstore.cache.assembly",
    "AssemblyOwner": "chunkstore.cache.assembly",
    "AssemblyOwnerStats": "chunkstore.cache.assembly",
    "SlotPool": "chunkstore.cache._pool",
    "StaleSlot": "chunkstore.cache._pool",
}


def __getattr__(name: str) -> object:
    return _lazy.lazy_attribute(__name__, _LAZY, name)


__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "ARCPolicy",
    "CachePolicy",
    "HostCache",
    "HostCacheStats",
    "LRUPolicy",
    "Lease",
    "PrefixARCPolicy",
    "make_policy",
]
