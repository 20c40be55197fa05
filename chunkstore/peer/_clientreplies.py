"""How a peer client reads replies: batching keys, checking fields, inline data frames.

A reply that breaks spec/PROTOCOL.md §4 fails like an unreachable peer's.
It never raises another exception.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from chunkstore.backends.base import ChunkInfo
from chunkstore.hashing import ChunkKey
from chunkstore.peer import _protocol as P
from chunkstore.peer._errors import PeerUnavailable, ProtocolViolation

if TYPE_CHECKING:
    from chunkstore.peer._clientconfig import PeerClientConfig
    from chunkstore.peer._metrics import PeerMetrics


class ReplyReading:
    """The part of :class:`~chunkstore.peer._client.PeerClient` that checks what peers send."""

    if TYPE_CHECKING:
        config: PeerClientConfig
        endpoint: str
        metrics: PeerMetrics
        server_info: dict[str, Any]

        def request(
            self,
            op: str,
            fields: dict[str, Any],
            data: Sequence[Any] = (),
            *,
            expect_reply: bool = True,
        ) -> tuple[dict[str, Any], list[Any]]: ...

    def _batches(self, keys: Sequence[ChunkKey]) -> Iterator[Sequence[ChunkKey]]:
        """Split ``keys`` into batches no larger than either side's ``max_keys``."""
        step = min(
            self.config.limits.max_keys,
            int(self.server_info.get("limits", {}).get("max_keys", self.config.limits.max_keys)),
        )
        for i in range(0, len(keys), step):
            yield keys[i : i + step]

    def _fetch_inline(
        self, keys: Sequence[ChunkKey], *, views: bool = False, use: bool = True
    ) -> list[Any]:
        """Fetch ``keys`` inline. Returns the bytes per key, or ``None`` where missing.

        ``views`` returns the received frames' memory instead of copying it to ``bytes``.
        """
        body: dict[str, Any] = {"keys": P.pack_keys(keys), "plane": P.PLANE_INLINE, "lease_ms": 0}
        if not use:
            body["use"] = False
        reply, data = self.request("fetch", body)
        sizes = reply.get("sizes")
        if (
            not isinstance(sizes, list)
            or len(sizes) != len(keys)
            or sum(1 for s in sizes if s is not None) != len(data)
        ):
            raise self._malformed("fetch")
        out: list[bytes | None] = []
        frames = iter(data)
        total = 0
        for size in sizes:
            if size is None:
                out.append(None)
                continue
            frame = next(frames)
            if hasattr(frame, "buffer"):
                blob = frame.buffer if views else frame.bytes
            else:
                blob = frame if views else bytes(frame)
            if len(blob) != size:
                raise PeerUnavailable(f"{self.endpoint}: a data frame has the wrong size")
            total += size
            out.append(blob)
        self.metrics.client_bytes.labels(P.PLANE_INLINE, "in").inc(total)
        return out

    def _stored(self, reply: dict[str, Any], n: int) -> list[tuple[bool, bool]]:
        """Per key of a push reply: whether the peer holds it, whether this push wrote it."""
        stored, written = self._per_key(reply, "stored", n), self._per_key(reply, "written", n)
        return [(bool(s), bool(w)) for s, w in zip(stored, written)]

    def _per_key(self, reply: dict[str, Any], name: str, n: int) -> list[Any]:
        """Return reply field ``name``, a list of one entry per key asked about (``n``)."""
        value = reply.get(name)
        if not isinstance(value, list) or len(value) != n:
            raise self._malformed(f"{name!r} of the")
        return value

    def _malformed(self, what: str) -> PeerUnavailable:
        """Count a malformed reply and return the PeerUnavailable to raise for it."""
        self.metrics.client_failures.labels("malformed_reply").inc()
        return PeerUnavailable(f"{self.endpoint}: malformed {what} reply")

    def _listed(self, entry: Any) -> ChunkInfo:
        """Read one ``list`` entry ``[wire key, size, mtime, atime]``.

        It is checked like a request field.
        """
        try:
            wire, size, mtime, atime = entry
            (key,) = P.unpack_keys(wire, self.config.limits)
            if not P.is_wire_int(size) or size < 0:
                raise ValueError("size")
            return ChunkInfo(key, size, float(mtime), float(atime))
        except (ValueError, TypeError, ProtocolViolation):
            raise PeerUnavailable(f"{self.endpoint}: malformed list entry") from None
