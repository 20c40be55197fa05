"""The peer service: instances share host-cached chunks.

Control goes over ZeroMQ, and data over NIXL or inline.
It sits above ``cache``, since a server serves a host cache in place.
It sits below ``vllm``.
See spec/PROTOCOL.md for the wire protocol.
:class:`PeerServer` exposes any store.
Its session and lease table is in ``sessions``, its request handlers in ``handlers``.
Its NIXL side is in ``staging``.
:class:`PeerClient` speaks to one server.
:class:`PeerStore` is the Store over one or more peers.
The ``discovery`` module finds them: a static list, a registry directory, or Redis.
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
