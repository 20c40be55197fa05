"""Peer store: instances share host-cached chunks (ZeroMQ control, NIXL or inline data).

See spec/PROTOCOL.md for the wire protocol. :class:`PeerServer` exposes any
store; :class:`PeerStore` is a store over one or more peers; the discovery
module finds them (static list, registry directory, Redis).
"""

from chunkstore.peer.client import NixlClientPlane, PeerClient, PeerClientConfig
from chunkstore.peer.discovery import (
    Announcer,
    FileRegistry,
    PeerInfo,
    PeerSource,
    RedisRegistry,
    Registry,
    StaticPeers,
    open_registry,
)
from chunkstore.peer.errors import PeerError, PeerRefused, PeerUnavailable
from chunkstore.peer.server import PeerServer, PeerServerConfig
from chunkstore.peer.store import PeerStore, open_peer_store

__all__ = [
    "Announcer",
    "FileRegistry",
    "NixlClientPlane",
    "PeerClient",
    "PeerClientConfig",
    "PeerError",
    "PeerInfo",
    "PeerRefused",
    "PeerServer",
    "PeerServerConfig",
    "PeerSource",
    "PeerStore",
    "PeerUnavailable",
    "RedisRegistry",
    "Registry",
    "StaticPeers",
    "open_peer_store",
    "open_registry",
]
