"""The peer service: instances share host-cached chunks (ZeroMQ control, NIXL or inline data).

It sits above ``cache`` (a server serves a host cache in place) and below
``vllm``. See spec/PROTOCOL.md for the wire protocol. :class:`PeerServer`
exposes any store (its session/lease table in ``sessions``, its request
handlers in ``handlers``, its NIXL side in ``staging``); :class:`PeerClient`
speaks to one server; :class:`PeerStore` is the Store over one or more peers;
the ``discovery`` module finds them (static list, registry directory, Redis).
Metrics go to an injectable :class:`PeerMetrics`.
"""

from chunkstore.peer._client import NixlClientPlane, PeerClient, PeerClientConfig
from chunkstore.peer._discovery import (
    Announcer,
    FileRegistry,
    PeerInfo,
    PeerSource,
    RedisRegistry,
    Registry,
    StaticPeers,
    open_registry,
)
from chunkstore.peer._errors import PeerError, PeerRefused, PeerUnavailable
from chunkstore.peer._metrics import PeerMetrics, default_peer_metrics
from chunkstore.peer._server import PeerServer
from chunkstore.peer._serverconfig import PeerServerConfig
from chunkstore.peer._store import PeerStore, open_peer_store

__all__ = [
    "Announcer",
    "FileRegistry",
    "NixlClientPlane",
    "PeerClient",
    "PeerClientConfig",
    "PeerError",
    "PeerInfo",
    "PeerMetrics",
    "PeerRefused",
    "PeerServer",
    "PeerServerConfig",
    "PeerSource",
    "PeerStore",
    "PeerUnavailable",
    "RedisRegistry",
    "Registry",
    "StaticPeers",
    "default_peer_metrics",
    "open_peer_store",
    "open_registry",
]
