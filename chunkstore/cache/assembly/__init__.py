"""TP shard assembly: the ranks of one engine write one chunk into one shared host slot.

A chunk holds every KV head (the format is TP-independent), but each TP rank
process holds only its own. So every rank writes its heads straight into its
byte ranges of one slot, and the chunk is sealed and published once, whole.
Two places run it:

* an engine's own shared pool (the vLLM connector at TP > 1): each rank's
  :class:`ShardAssembler` claims slots the :class:`AssemblyOwner` lends from
  the host cache it owns, and the owner publishes what the ranks sealed;
* the node service: a server's :class:`NodeAssemblies` gives the ranks of
  one engine the same reserved slot (one :class:`RankPart` each) and seals
  and publishes the chunk when every part is committed.
"""

from chunkstore.cache.assembly._assembler import ShardAssembler, ShardAssemblerStats
from chunkstore.cache.assembly._node import NodeAssemblies, RankPart
from chunkstore.cache.assembly._owner import AssemblyOwner, AssemblyOwnerStats

__all__ = [
    "AssemblyOwner",
    "AssemblyOwnerStats",
    "NodeAssemblies",
    "RankPart",
    "ShardAssembler",
    "ShardAssemblerStats",
]
