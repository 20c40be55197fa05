"""NodeServer: the node service, a peer server whose ``shm`` plane lends the host pool's slots.

The service of ``chunkstore serve --node`` listens on a unix socket of the
machine (``ipc://``, created owner-only) and serves a host cache whose slot
pool lives in ``/dev/shm``. Besides the peer protocol's other planes it
offers ``shm`` (:class:`~chunkstore.node._shmplane.ShmPlane`): engines map
the pool and read or write chunks in place (spec/PROTOCOL.md, plane ``shm``).
"""

from __future__ import annotations

from chunkstore.node._clientseries import NodeClientSeries
from chunkstore.node._shmplane import ShmPlane
from chunkstore.peer._accounting import ClientSeries
from chunkstore.peer._handlers import SlotPlane
from chunkstore.peer._server import PeerServer


class NodeServer(PeerServer):
    """Serves ``store`` to the engines of this machine. ``store`` is a host cache in shared
    memory, or a tiered store over one. This is a :class:`~chunkstore.peer.PeerServer`
    that also offers the ``shm`` plane. Ask for it with ``planes=("shm",)`` and an
    ``ipc://`` bind.

    ``seal_layout`` is the served model's chunk layout. With it, the server seals the
    chunks whose parts the ranks of TP engines write.
    """

    def _client_series(self) -> ClientSeries | None:
        return NodeClientSeries(self.metrics, lambda: self.name)

    def _open_slot_plane(self) -> tuple[SlotPlane | None, str | None]:
        return ShmPlane.open(self.store, valid=self._valid, seal_layout=self.config.seal_layout)


__all__ = ["NodeServer"]
