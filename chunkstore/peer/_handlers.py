"""The peer server's request handlers: one method per protocol operation.

Requests reach :meth:`RequestHandlers.handle` already decoded and authenticated.
They are checked against the field grammar by ``protocol.validate_request``.
Except for ``hello``, they come within a known session.
Each handler returns the reply fields, the data frames and a callback.
The callback runs once the frames are sent, and unpins what they point at.
A handler raises ProtocolViolation for an error reply.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

from chunkstore.backends.base import Store, SupportsPinning, SupportsReserve, judge
from chunkstore.hashing import ChunkKey
from chunkstore.peer import _protocol as P
from chunkstore.peer._accounting import ServerAccounting
from chunkstore.peer._errors import ProtocolViolation
from chunkstore.peer._serverconfig import PeerServerConfig
from chunkstore.peer._sessions import Session, SessionTable
from chunkstore.peer._staging import NixlStaging

log = logging.getLogger(__name__)

Result = tuple[dict[str, Any], Sequence[Any], Callable[[], None] | None]
"""Reply fields, data frames, and what to call once the frames are sent."""

Validity = Callable[[ChunkKey, Any], bool]
"""Whether a chunk a client sent may be stored under its key (see :func:`push_check`)."""


class SlotPlane(Protocol):
    """A data plane lending the slots of a pool its clients map.
    That is the node service's ``shm``, see :class:`chunkstore.node.NodeServer`.
    Reads name pinned slots. Writes reserve slots the client fills in place.
    Each call answers a request of a session offered the plane."""

    def hello_fields(self, slot_size: int | None) -> dict[str, Any]:
        """What a client needs to map the pool.
        Raises ProtocolViolation when its chunks, of ``slot_size`` bytes, are not the pool's."""
        ...

    def lend(self, keys: Sequence[ChunkKey]) -> tuple[list[Any], list[Callable[[], None]]]:
        """Pin each held chunk in its slot: the reply items and the calls that unpin."""
        ...

    def reserve(
        self, body: dict[str, Any], keys: list[ChunkKey], present: list[bool], owner: Session
    ) -> tuple[list[Any], list[Any], list[Callable[[], None]]]:
        """A writable slot per key not ``present``, for ``owner``'s ``reserve`` request ``body``.
        Returns the reply items, what the lease holds, and the calls that abort."""
        ...

    def commit(self, held: list[Any], sizes: list[int]) -> list[bool]:
        """Publish what a lease holds, or give it back with size 0. Returns per key: stored."""
        ...

    def session_ended(self, session: Session) -> None:
        """Give up what ``session`` was still writing."""
        ...


def push_check(
    config: PeerServerConfig, accounting: ServerAccounting, name: Callable[[], str]
) -> Validity:
    """The check every chunk a client sends (push, commit) passes before it is stored."""

    def valid(key: ChunkKey, blob: Any) -> bool:
        if not config.verify_push:
            return True
        # Every verdict but OK turns a push away: the server stores only chunks it can check
        # as the one named (not a newer chunkstore's, not another model's, not damaged).
        judgement = judge(key, blob, expected_fingerprint=config.fingerprint)
        if not judgement.ok:
            log.warning(
                "peer server %s: pushed chunk %s refused: %s", name(), key.hex, judgement.error
            )
            accounting.count("pushed_corrupt")
        return judgement.ok

    return valid


class RequestHandlers:
    """Answers the requests of one peer server over ``store``.

    ``planes`` and ``nixl_reason`` are what the server offers after starting NIXL.
    ``staging`` is its NIXL side, ``None`` without NIXL.
    ``shm`` is its slot plane, ``None`` without one.
    ``name`` and ``stats`` give the server's name and ``stats`` record.
    ``valid`` checks what clients send, see :func:`push_check`.
    """

    def __init__(
        self,
        store: Store,
        config: PeerServerConfig,
        *,
        sessions: SessionTable,
        accounting: ServerAccounting,
        staging: NixlStaging | None,
        planes: tuple[str, ...],
        nixl_reason: str | None,
        name: Callable[[], str],
        stats: Callable[[], dict[str, Any]],
        valid: Validity,
        shm: SlotPlane | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self._sessions = sessions
        self._accounting = accounting
        self._staging = staging
        self._planes = planes
        self._nixl_reason = nixl_reason
        self._name = name
        self._stats = stats
        self._shm = shm
        self._valid = valid
        self._pinning = store if isinstance(store, SupportsPinning) else None
        self._reserving = store if isinstance(store, SupportsReserve) else None
        self._ops: dict[str, Callable[[dict[str, Any], list[Any]], Result | None]] = {
            "lookup": self._op_lookup,
            "exists": self._op_exists,
            "fetch": self._op_fetch,
            "release": self._op_release,
            "push": self._op_push,
            "reserve": self._op_reserve,
            "commit": self._op_commit,
            "delete": self._op_delete,
            "list": self._op_list,
            "stats": self._op_stats,
            "bye": self._op_bye,
        }

    def handle(
        self, body: dict[str, Any], data: list[Any], source: str, connection: int | None = None
    ) -> Result | None:
        """The reply to one request. ``None`` means no reply, for a release without ``ack``.

        ``source`` is the sender's address.
        ``connection`` is its connection on a local ``ipc://`` server.
        Sessions there end with their connection.
        Only ``hello`` uses either.
        """
        if body["op"] == "hello":
            return self._op_hello(body, source, connection)
        return self._ops[body["op"]](body, data)

    # --- sessions -------------------------------------------------------------------------

    def _op_hello(self, body: dict[str, Any], source: str, connection: int | None) -> Result:
        cfg = self.config
        if P.PROTOCOL_VERSION not in body["versions"]:
            raise ProtocolViolation(
                P.UNSUPPORTED_VERSION,
                f"no common protocol version (this peer speaks {sorted(P.ACCEPTED_VERSIONS)})",
            )
        fp = body["fingerprint"]
        if cfg.fingerprint is not None and fp is not None and fp != cfg.fingerprint:
            raise ProtocolViolation(
                P.FINGERPRINT_MISMATCH,
                f"this peer serves model fingerprint {cfg.fingerprint.hex()[:16]}…, "
                f"the client has {fp.hex()[:16]}…",
            )
        tokens = body["chunk_tokens"]
        if cfg.chunk_tokens is not None and tokens is not None and tokens != cfg.chunk_tokens:
            raise ProtocolViolation(
                P.CHUNK_TOKENS_MISMATCH,
                f"this peer serves {cfg.chunk_tokens}-token chunks, the client uses {tokens}",
            )
        planes = tuple(p for p in self._planes if p in body["planes"])
        shm_fields: dict[str, Any] = {}
        if P.PLANE_SHM in planes:
            assert self._shm is not None  # shm is offered only with its plane
            shm_fields = self._shm.hello_fields(body.get("slot_size"))
        nixl_reason = self._nixl_reason
        staging = self._staging
        remote = None
        if P.PLANE_NIXL in planes and body["nixl_md"]:
            remote = staging.endpoint.add_remote(body["nixl_md"]) if staging is not None else None
            if remote is None:
                # Metadata NIXL cannot load would fail every transfer of this session.
                planes = tuple(p for p in planes if p != P.PLANE_NIXL)
                nixl_reason = "NIXL rejected the client's agent metadata"
        client = body["client"]
        session = Session(
            client=client,
            # Each connection of a node service is its own identity: engines may share a name.
            identity=(f"fd{connection}" if connection is not None else source, client),
            planes=planes,
            nixl_remote=remote,
            last_seen=time.monotonic(),
            retained=len(client.encode("utf-8", "surrogatepass")) + len(body["nixl_md"] or b""),
            connection=connection,
        )
        session_id = P.new_token(P.SESSION_BYTES)
        self._sessions.admit(session_id, session)
        reply: dict[str, Any] = {
            "s": session_id,
            "server": self._name(),
            "version": P.PROTOCOL_VERSION,
            "fingerprint": cfg.fingerprint,
            "chunk_tokens": cfg.chunk_tokens,
            "planes": list(planes),
            "limits": cfg.limits.as_dict(),
            "lease_ms_max": cfg.max_lease_ms,
            "read_only": cfg.read_only,
            "staging_bytes": staging.arena.size if staging else 0,
            "nixl_reason": nixl_reason,
        }
        if staging is not None and P.PLANE_NIXL in planes:
            reply["nixl_md"] = staging.endpoint.metadata()
            reply["nixl_agent"] = staging.endpoint.name
        reply.update(shm_fields)
        return reply, (), None

    def _op_bye(self, body: dict[str, Any], data: list[Any]) -> Result:
        self._sessions.end(body["s"])
        return {}, (), None

    def session_ended(self, session: Session) -> None:
        """Give up what ``session`` was still writing over the slot plane.
        Those are the TP chunks its rank joined that are not whole yet."""
        if self._shm is not None:
            self._shm.session_ended(session)

    def _session_with_plane(self, session_id: bytes, plane: str) -> Session:
        session = self._sessions.get(session_id)
        if plane not in session.planes:
            raise ProtocolViolation(P.DATAPLANE_UNAVAILABLE, f"data plane {plane!r} is not offered")
        return session

    # --- lookups --------------------------------------------------------------------------

    def _op_lookup(self, body: dict[str, Any], data: list[Any]) -> Result:
        keys = P.unpack_keys(body["keys"], self.config.limits)
        return {"prefix": self.store.lookup_prefix(keys) if keys else 0}, (), None

    def _op_exists(self, body: dict[str, Any], data: list[Any]) -> Result:
        keys = P.unpack_keys(body["keys"], self.config.limits)
        return {"present": self.store.exists_many(keys) if keys else []}, (), None

    def _op_list(self, body: dict[str, Any], data: list[Any]) -> Result:
        # namespace, after and limit follow the field grammar (validate_request): nothing
        # path-like reaches the store.
        limit = min(body["limit"], self.config.limits.max_keys)
        after = body["after"]
        entries = sorted(
            (P.pack_keys([info.key]), info.size, info.mtime, info.atime)
            for info in self.store.list(body["namespace"])
        )
        start = 0
        if after is not None:
            start = bisect.bisect_right(entries, (after, float("inf")))
        page = entries[start : start + limit]
        return {"entries": [list(e) for e in page], "more": start + limit < len(entries)}, (), None

    def _op_stats(self, body: dict[str, Any], data: list[Any]) -> Result:
        return {"stats": self._stats()}, (), None

    # --- reads ----------------------------------------------------------------------------

    def _op_fetch(self, body: dict[str, Any], data: list[Any]) -> Result:
        keys = P.unpack_keys(body["keys"], self.config.limits)
        plane = body["plane"]
        self._session_with_plane(body["s"], plane)
        # `use: false` marks a maintenance read (verify, cp): it must not count as a use of
        # the chunks, so no pins (acquire counts a hit) and no access-time update.
        use = body.get("use", True)
        if plane == P.PLANE_NIXL:
            return self._fetch_nixl(body, keys, use=use)
        if plane == P.PLANE_SHM:
            return self._fetch_shm(body["s"], keys)
        return self._fetch_inline(keys, use=use)

    def _read(self, keys: list[ChunkKey], use: bool) -> list[Any]:
        return self.store.get_many(keys) if use else self.store.read_unchecked_many(keys)

    def _fetch_inline(self, keys: list[ChunkKey], *, use: bool = True) -> Result:
        sizes: list[int | None] = []
        frames: list[Any] = []
        releases: list[Callable[[], None]] = []
        budget = self.config.limits.max_message_bytes
        pinning = self._pinning if use else None
        if pinning is not None:
            for key in keys:
                pin = pinning.acquire(key)
                if pin is None or len(pin.view) > budget:
                    if pin is not None:
                        pinning.release(pin)
                    sizes.append(None)
                    continue
                budget -= len(pin.view)
                sizes.append(len(pin.view))
                frames.append(pin.view)
                releases.append(partial(pinning.release, pin))
        else:
            for blob in self._read(keys, use):
                if blob is None or len(blob) > budget:
                    sizes.append(None)
                    continue
                budget -= len(blob)
                sizes.append(len(blob))
                frames.append(blob)
        hits = len(frames)
        self._accounting.served(hits, len(keys) - hits, P.PLANE_INLINE, sum(s or 0 for s in sizes))

        def on_sent() -> None:
            for release in releases:
                release()

        return {"sizes": sizes}, frames, on_sent if releases else None

    def _fetch_nixl(self, body: dict[str, Any], keys: list[ChunkKey], *, use: bool) -> Result:
        assert self._staging is not None  # the nixl plane is offered only with staging
        cfg = self.config
        lease_ms = min(body["lease_ms"] or cfg.default_lease_ms, cfg.max_lease_ms)
        items, releases = self._staging.lend(
            keys,
            pinning=self._pinning if use else None,
            read=partial(self._read, use=use),
            count=self._accounting.count,
        )
        hits = sum(item is not None for item in items)
        nbytes = sum(item[1] for item in items if item)
        self._accounting.served(hits, len(keys) - hits, P.PLANE_NIXL, nbytes)
        lease_id = self._sessions.open_lease(body["s"], releases, lease_ms)
        return {"lease": lease_id, "lease_ms": lease_ms, "items": items}, (), None

    def _fetch_shm(self, session_id: bytes, keys: list[ChunkKey]) -> Result:
        assert self._shm is not None  # the shm plane is offered only with it
        client = self._sessions.get(session_id).client  # before pinning: it may raise
        items, releases = self._shm.lend(keys)
        hits = len(releases)
        nbytes = sum(item[2] for item in items if item)
        self._accounting.served(hits, len(keys) - hits, P.PLANE_SHM, nbytes)
        self._accounting.client_served(client, hits, len(keys) - hits)
        # The pins are the server's, held for the client until it releases them or its
        # connection closes: no timer, so a slot is never reused under a live reader.
        lease_id = self._sessions.open_lease(session_id, releases, None)
        return {"lease": lease_id, "items": items}, (), None

    def _op_release(self, body: dict[str, Any], data: list[Any]) -> Result | None:
        released = self._sessions.close_lease(body["s"], body["lease"])
        if not body["ack"]:
            return None
        if not released:
            raise ProtocolViolation(P.UNKNOWN_LEASE, "no such lease (expired or released)")
        return {"released": True}, (), None

    # --- writes ---------------------------------------------------------------------------

    def _op_push(self, body: dict[str, Any], data: list[Any]) -> Result:
        if self.config.read_only:
            raise ProtocolViolation(P.READ_ONLY, "this peer does not accept pushed chunks")
        keys = P.unpack_keys(body["keys"], self.config.limits)
        sizes = body["sizes"]  # non-negative and within the frame limit (validate_request)
        plane = body["plane"]
        if len(sizes) != len(keys):
            raise ProtocolViolation(P.MALFORMED, "push: one size per key is required")
        session = self._session_with_plane(body["s"], plane)
        stored = [False] * len(keys)
        written = [False] * len(keys)
        todo = list(range(len(keys)))
        if body["mode"] == "if_absent":
            present = self.store.exists_many(keys)
            stored = list(present)
            todo = [i for i, here in enumerate(present) if not here]
        if plane == P.PLANE_INLINE:
            if len(data) != len(keys):
                raise ProtocolViolation(P.MALFORMED, "push: one data frame per key is required")
            blobs: list[Any] = [
                frame.buffer if hasattr(frame, "buffer") else frame for frame in data
            ]
            if any(len(b) != s for b, s in zip(blobs, sizes)):
                raise ProtocolViolation(P.MALFORMED, "push: frame sizes disagree with 'sizes'")
            direct: list[int] = []
        else:
            addrs = body["addrs"]
            if len(addrs) != len(keys):
                raise ProtocolViolation(P.MALFORMED, "push: one source address per key is required")
            blobs = [None] * len(keys)
            direct = self._pull_nixl(session, keys, sizes, addrs, todo, blobs)
        for i in direct:
            stored[i] = written[i] = True
        skip = set(direct)
        accepted = [
            (i, keys[i], blobs[i])
            for i in todo
            if i not in skip and blobs[i] is not None and self._valid(keys[i], blobs[i])
        ]
        if accepted:
            items = [(k, b) for _, k, b in accepted]
            results = (
                self.store.put_many(items)
                if body["mode"] == "overwrite"
                else self.store.put_if_absent_many(items)
            )
            here = self.store.exists_many([k for _, k, _ in accepted])
            for (i, _, _), wrote, ok in zip(accepted, results, here):
                written[i], stored[i] = bool(wrote), bool(ok)
        nbytes = sum(sizes[i] for i in range(len(keys)) if written[i])
        self._accounting.taken_in(plane, nbytes, sum(written))
        return {"stored": stored, "written": written}, (), None

    def _pull_nixl(
        self,
        session: Session,
        keys: list[ChunkKey],
        sizes: list[int],
        addrs: list[int],
        todo: list[int],
        blobs: list[Any],
    ) -> list[int]:
        if session.nixl_remote is None or self._staging is None:
            raise ProtocolViolation(
                P.DATAPLANE_UNAVAILABLE, "push over NIXL needs NIXL metadata in hello"
            )
        return self._staging.pull(
            session.nixl_remote,
            keys,
            sizes,
            addrs,
            todo,
            blobs,
            reserving=self._reserving,
            valid=self._valid,
            deadline=time.monotonic() + self.config.default_lease_ms / 1000,
            count=self._accounting.count,
        )

    def _op_reserve(self, body: dict[str, Any], data: list[Any]) -> Result:
        if self.config.read_only:
            raise ProtocolViolation(P.READ_ONLY, "this node does not accept chunks")
        keys = P.unpack_keys(body["keys"], self.config.limits)
        session = self._session_with_plane(body["s"], body["plane"])
        if body["plane"] != P.PLANE_SHM:
            raise ProtocolViolation(P.DATAPLANE_UNAVAILABLE, "reserve is for the shm plane only")
        assert self._shm is not None
        present = (
            self.store.exists_many(keys)
            if body["mode"] == "if_absent" and keys
            else [False] * len(keys)
        )
        items, held, releases = self._shm.reserve(body, keys, present, session)
        lease_id = self._sessions.open_lease(body["s"], releases, None, held=held)
        return {"lease": lease_id, "items": items, "present": list(present)}, (), None

    def _op_commit(self, body: dict[str, Any], data: list[Any]) -> Result:
        lease = self._sessions.take_lease(body["s"], body["lease"])
        if lease is None:
            raise ProtocolViolation(P.UNKNOWN_LEASE, "no such reservation (committed or ended)")
        sizes = body["sizes"]  # non-negative and within the frame limit (validate_request)
        if not lease.held or len(sizes) != len(lease.held):
            for release in lease.releases:
                release()
            raise ProtocolViolation(
                P.MALFORMED, "commit: names a reservation and one size per reserved key"
            )
        assert self._shm is not None  # reservations exist only with the shm plane
        stored = self._shm.commit(lease.held, sizes)
        nbytes = sum(size for size, ok in zip(sizes, stored) if ok)
        self._accounting.taken_in(P.PLANE_SHM, nbytes, sum(stored))
        return {"stored": stored}, (), None

    def _op_delete(self, body: dict[str, Any], data: list[Any]) -> Result:
        if self.config.read_only:
            raise ProtocolViolation(P.READ_ONLY, "this peer does not accept deletes")
        keys = P.unpack_keys(body["keys"], self.config.limits)
        present = self.store.exists_many(keys) if keys else []
        gone = [k for k, here in zip(keys, present) if here]
        if gone:
            self.store.delete_many(gone)
        return {"deleted": present}, (), None
