"""One host cache per machine: engines attach to the node service of ``chunkstore serve --node``.

Both halves of the service are here. :class:`NodeServer` is a
:class:`~chunkstore.peer.PeerServer` on a unix socket that offers the ``shm``
plane. It owns the host slot pool in ``/dev/shm``, the replacement policy, the
tiers and the write-behind. Every engine of the machine maps the pool and reads
or writes chunks in place. :class:`NodeClient` is one engine's attachment.
:class:`NodeStore` is the Store over it. :class:`NodeCache` and
:class:`NodeRankCache` are the :class:`~chunkstore.tiering.EngineCache` an engine
adapter saves into and loads from on the service. See "One cache per node" in
docs/cache.md, and the ``shm`` plane in spec/PROTOCOL.md.
"""

from chunkstore.node._client import (
    NodeClient,
    NodeRead,
    NodeRefused,
    NodeReservation,
    RankShare,
    engine_identity,
    node_endpoint,
)
from chunkstore.node._engine import NodeCache, NodeRankCache, NodeSlot
from chunkstore.node._server import NodeServer
from chunkstore.node._store import NodeStore

__all__ = [
    "NodeCache",
    "NodeClient",
    "NodeRead",
    "NodeRefused",
    "NodeRankCache",
    "NodeReservation",
    "NodeServer",
    "NodeSlot",
    "NodeStore",
    "RankShare",
    "engine_identity",
    "node_endpoint",
]
