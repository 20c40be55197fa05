"""NodeStore: the Store over a node service, every byte through the mapped pool.

Reads copy a chunk straight out of the slot the service pinned for us. They
check afterwards that the slot was not reassigned. Writes fill a slot the
service reserved and commit it. The service checks the chunk before anyone can
read it. When the service is down every read is a miss. Every write is then
refused with False. An engine recomputes instead of waiting.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from chunkstore.backends.base import Buffer, ChunkInfo, Store
from chunkstore.errors import ConfigError
from chunkstore.hashing import ChunkKey
from chunkstore.node._client import NodeClient


class NodeStore(Store):
    """Chunks held by this machine's node service. See :class:`NodeClient`.

    ``verify`` defaults to False as for a host cache. The service checked every
    chunk when it entered, on commit or on promotion from a tier.
    """

    kind = "node"

    def __init__(self, client: NodeClient, *, name: str | None = None, verify: bool = False):
        super().__init__(name=name, verify=verify)
        self.client = client
        """The attachment to the service."""

    @property
    def supports_listing(self) -> bool:
        """Listing is not offered: the node's chunks are the host cache's, listed by it."""
        return False

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        read = self.client.acquire(keys)
        try:
            out: list[bytes | None] = []
            for i, view in enumerate(read.views):
                blob = bytes(view) if view is not None else None
                out.append(blob if blob is not None and self.client.still_valid(read, i) else None)
            return out
        finally:
            self.client.release(read)

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Copy one chunk from its slot into ``buffer``; its size, or ``None`` on a miss."""
        read = self.client.acquire([key])
        try:
            view = read.views[0]
            if view is None:
                return None
            target = memoryview(buffer).cast("B")
            if target.readonly or len(target) < len(view):
                raise ConfigError(f"get_into needs a writable buffer of {len(view)} bytes")
            target[: len(view)] = view
            if not self.client.still_valid(read, 0):
                return None
            if self.verify and self._checked(key, target[: len(view)]) is None:
                return None
            return len(view)
        finally:
            self.client.release(read)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.client.exists(keys)

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys the node holds: one round trip."""
        return self.client.lookup(keys)

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._put(items, if_absent=False)

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        return self._put(items, if_absent=True)

    def _put(self, items: Sequence[tuple[ChunkKey, Buffer]], *, if_absent: bool) -> list[bool]:
        if not items:
            return []
        reservation = self.client.reserve([key for key, _ in items], if_absent=if_absent)
        sizes: list[int] = []
        try:
            for (_, data), slot in zip(items, reservation.views):
                source = memoryview(data).cast("B")
                if slot is None or len(source) > len(slot):
                    sizes.append(0)
                    continue
                slot[: len(source)] = source
                sizes.append(len(source))
        except BaseException:
            self.client.abort(reservation)
            raise
        return self.client.commit(reservation, sizes)

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        return sum(self.client.delete(keys)) if keys else 0

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        """Nothing: see :attr:`supports_listing`."""
        return iter(())

    def close(self) -> None:
        """Detach from the service. It releases whatever we still held."""
        self.client.close()


__all__ = ["NodeStore"]
