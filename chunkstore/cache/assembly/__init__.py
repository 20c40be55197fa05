"""TP shard assembly: the ranks of one engine write one chunk into one shared host slot.

A chunk holds every KV head, since the format is TP-independent.
Each TP rank process holds only its own heads.
So every rank writes its heads straight into its byte ranges of one slot.
The chunk is sealed and published once, whole.
Two places run it:

* An engine's own shared pool, as in the vLLM connector at TP > 1.
  Each rank's :class:`ShardAssembler` claims slots that the :class:`AssemblyOwner` lends.
  The owner lends them from the host cache it owns, and publishes what the ranks sealed.
* The node service. A server's :class:`NodeAssemblies` gives the ranks of one engine the
  same reserved slot, with one :class:`RankPart` each.
  It seals and publishes the chunk when every part is committed.
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
