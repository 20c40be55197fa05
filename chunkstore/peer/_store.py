"""PeerStore: a Store over one or more peer servers, usable as a tier of a TieredStore.

Reads ask every peer in parallel and take the best answer.
A peer that fails is a miss, never an exception, and is skipped for ``retry_after_s``.
One read call is bounded by one ``timeout_s`` in total.
Its requests to a peer share a deadline set when the call starts.
Those are ``hello``, ``exists``, ``fetch`` and the NIXL READ.
Every chunk that arrives is verified before it is returned.
The checks are the checksum and key, and the fingerprint or MAC when configured.
A partial or damaged transfer is a miss.
Writes push chunks to the peer with the most free capacity.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from chunkstore.backends.base import Buffer, ChunkInfo, Judgement, ReadVerdict, Store, judge
from chunkstore.errors import ConfigError, StoreError
from chunkstore.hashing import ChunkKey
from chunkstore.peer._client import (
    NixlClientPlane,
    PeerClient,
    PeerClientConfig,
    peer_endpoint,
)
from chunkstore.peer._discovery import PeerInfo, PeerSource, StaticPeers
from chunkstore.peer._errors import PeerError, PeerRefused
from chunkstore.peer._metrics import PeerMetrics, default_peer_metrics
from chunkstore.peer._nixlplane import nixl_unavailable_reason
from chunkstore.peer._protocol import PLANE_INLINE, PLANE_NIXL

log = logging.getLogger(__name__)

T = TypeVar("T")
_HINTS = 65536  # keys whose location we remember (from lookup_prefix and exists)


class PeerStore(Store):
    """Chunks held by peers. ``peers`` is a list of endpoints or a discovery source."""

    kind = "peer"

    def __init__(
        self,
        peers: Sequence[str] | PeerSource,
        config: PeerClientConfig | None = None,
        *,
        name: str | None = None,
        verify: bool = True,
        mac_key: bytes | None = None,
        refresh_s: float = 2.0,
        stats_ttl_s: float = 1.0,
        metrics: PeerMetrics | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__(name=name, verify=verify)
        self.config = replace(config or PeerClientConfig(), **overrides)
        self.metrics = metrics or default_peer_metrics()
        """Where this store's clients report (``chunkstore_peer_client_*``)."""
        if isinstance(peers, (list, tuple)):
            peers = StaticPeers(list(peers))
            for info in peers.peers():
                peer_endpoint(info.endpoint)  # a typo is the caller's error, raised now
        if not isinstance(peers, PeerSource):
            raise ConfigError("peers must be a list of endpoints or a discovery source")
        self.source: PeerSource = peers
        self.mac_key = mac_key
        self.refresh_s = refresh_s
        self.stats_ttl_s = stats_ttl_s
        self._clients: dict[str, PeerClient] = {}
        self._infos: dict[str, PeerInfo] = {}
        self._refreshed = 0.0
        self._source_down = False  # the last read of the source failed (warned once)
        self._lock = threading.Lock()
        self._hints: OrderedDict[ChunkKey, str] = OrderedDict()
        self._refused: set[str] = set()  # endpoints of records we cannot connect to, warned once
        self._retiring: set[PeerClient] = set()  # clients of departed peers being closed
        # Per reading thread: which peer sent each chunk of the read in progress, so that a
        # damaged one is removed from that peer only (see _quarantine).
        self._senders = threading.local()
        self._stats_cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self._nixl: NixlClientPlane | None = None
        self._nixl_tried = False
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="peer-store")
        self._closed = False

    # --- capabilities ----------------------------------------------------------------

    @property
    def high_latency(self) -> bool:
        return True

    @property
    def supports_listing(self) -> bool:
        return True

    # --- peers -------------------------------------------------------------------------

    def _shared_nixl(self) -> NixlClientPlane | None:
        if self.config.plane == PLANE_INLINE:
            return None
        with self._lock:
            if not self._nixl_tried:
                self._nixl_tried = True
                if nixl_unavailable_reason() is None:
                    try:
                        self._nixl = NixlClientPlane(self.config.recv_arena_bytes)
                    except Exception as exc:  # noqa: BLE001 - clients fall back and report it
                        log.warning("NIXL client plane could not start: %s", exc)
            return self._nixl

    def clients(self) -> list[PeerClient]:
        """One client per live peer (the source is re-read every ``refresh_s``)."""
        now = time.monotonic()
        if now - self._refreshed >= self.refresh_s or (not self._clients and not self._source_down):
            try:
                infos = self.source.peers()
            except StoreError as exc:
                # An unreachable registry is not an empty one: keep the peers known (each
                # client turns its own peer's death into misses) and ask again after
                # refresh_s, not on every read (a Redis timeout per read would stall them).
                if not self._source_down:
                    log.warning(
                        "%s: keeping the %d peers known: %s", self.name, len(self._clients), exc
                    )
                self._source_down = True
                self._refreshed = now
                with self._lock:
                    return list(self._clients.values())
            if self._source_down:
                log.warning("%s: peer discovery readable again", self.name)
                self._source_down = False
            nixl = self._shared_nixl()
            with self._lock:
                self._refreshed = now
                wanted = {}
                for info in infos:
                    if (
                        self.config.fingerprint is not None
                        and info.fingerprint
                        and info.fingerprint != self.config.fingerprint.hex()
                    ):
                        continue
                    wanted[info.endpoint] = info
                for endpoint in list(self._clients):
                    if endpoint not in wanted:
                        self._retire(self._clients.pop(endpoint))
                        self._infos.pop(endpoint, None)
                for endpoint, info in wanted.items():
                    if endpoint not in self._clients:
                        client = self._client_for(info, nixl)
                        if client is None:
                            continue
                        self._clients[endpoint] = client
                    self._infos[endpoint] = info
        with self._lock:
            return list(self._clients.values())

    def _retire(self, client: PeerClient) -> None:
        """Close the client of a peer that left discovery, off the caller's path.
        The caller holds the lock.
        The client's goodbye waits for a reply, and a peer that left has often died.
        Closing it here would cost the read that noticed a whole timeout, under the lock."""
        self._retiring.add(client)

        def close() -> None:
            client.close()
            with self._lock:
                self._retiring.discard(client)

        try:
            self._pool.submit(close)
        except RuntimeError:  # the store is closing: close() takes care of it
            pass

    def _client_for(self, info: PeerInfo, nixl: NixlClientPlane | None) -> PeerClient | None:
        """A client for a discovered peer.
        ``None``, warned once, for a record whose endpoint no client can connect to.
        Anyone who can write a registry can write a record.
        One bad record must not turn every read into an exception."""
        try:
            endpoint = peer_endpoint(info.endpoint)
        except ConfigError as exc:
            if info.endpoint not in self._refused:
                self._refused.add(info.endpoint)
                log.warning("%s: peer %r skipped: %s", self.name, info.name, exc)
            return None
        config = self.config
        if info.curve_public_key and config.curve_server_key is None:
            config = replace(config, curve_server_key=info.curve_public_key.encode())
        return PeerClient(endpoint, config, nixl=nixl, metrics=self.metrics)

    def dataplanes(self) -> dict[str, str | None]:
        """The data plane each peer uses (``None`` until its first request)."""
        return {c.endpoint: c.plane for c in self.clients()}

    def _deadline(self) -> float:
        """When a read call starting now must be over: one ``timeout_s`` from now."""
        return time.monotonic() + self.config.timeout_s

    def _each(
        self,
        clients: Sequence[PeerClient],
        call: Callable[[PeerClient], T],
        deadline: float | None = None,
    ) -> list[T | None]:
        """``call`` on every available client in parallel. ``None`` where it failed.
        ``deadline`` is a monotonic time. Every request of ``call`` ends by then, or misses."""
        live = [c for c in clients if c.available]

        def safe(client: PeerClient) -> T | None:
            try:
                with client.within(deadline):
                    return call(client)
            except PeerError as exc:
                log.info("peer %s: %s", client.endpoint, exc)
                return None

        if len(live) <= 1:
            results = [safe(c) for c in live]
        else:
            results = list(self._pool.map(safe, live))
        by_endpoint = {c.endpoint: r for c, r in zip(live, results)}
        return [by_endpoint.get(c.endpoint) for c in clients]

    def _hint(self, keys: Sequence[ChunkKey], endpoint: str) -> None:
        with self._lock:
            for key in keys:
                self._hints[key] = endpoint
                self._hints.move_to_end(key)
            while len(self._hints) > _HINTS:
                self._hints.popitem(last=False)

    # --- reads -------------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Ask every peer for its prefix length in parallel. The longest wins."""
        if not keys:
            return 0
        clients = self.clients()
        answers = self._each(clients, lambda c: c.lookup(keys), self._deadline())
        best, best_client = 0, None
        for client, answer in zip(clients, answers):
            if answer is not None and answer > best:
                best, best_client = answer, client
        if best_client is not None:
            self._hint(keys[:best], best_client.endpoint)
        return best

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        clients = self.clients()
        answers = self._each(clients, lambda c: c.exists(keys), self._deadline())
        out = [False] * len(keys)
        for client, answer in zip(clients, answers):
            if answer is None:
                continue
            found = [k for k, here in zip(keys, answer) if here]
            self._hint(found, client.endpoint)
            out = [a or b for a, b in zip(out, answer)]
        return out

    def _locate(self, keys: Sequence[ChunkKey], deadline: float) -> dict[str, list[int]]:
        """Which peer to ask for each key: remembered hints first, then one exists round
        (ending by ``deadline``)."""
        clients = {c.endpoint: c for c in self.clients()}
        plan: dict[str, list[int]] = {}
        unknown = []
        with self._lock:
            for i, key in enumerate(keys):
                endpoint = self._hints.get(key)
                if endpoint in clients and clients[endpoint].available:
                    plan.setdefault(endpoint, []).append(i)
                else:
                    unknown.append(i)
        if unknown:
            asked = [keys[i] for i in unknown]
            ordered = list(clients.values())
            answers = self._each(ordered, lambda c: c.exists(asked), deadline)
            for pos, i in enumerate(unknown):
                for client, answer in zip(ordered, answers):
                    if answer is not None and answer[pos]:
                        plan.setdefault(client.endpoint, []).append(i)
                        break
        return plan

    def _read_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        self._senders.of = {}
        if not keys:
            return out
        deadline = self._deadline()
        self._fetch_into_list(keys, list(range(len(keys))), out, deadline)
        missed = [i for i, blob in enumerate(out) if blob is None]
        if missed:  # a remembered location may be stale: forget it and ask everyone once
            with self._lock:
                stale = [i for i in missed if self._hints.pop(keys[i], None) is not None]
            if stale:
                self._fetch_into_list(keys, stale, out, deadline)
        return out

    def read_unchecked_many(self, keys: Sequence[ChunkKey]) -> list[bytes | None]:
        """Raw bytes per key, unverified, and not a use: peers neither pin nor touch them."""
        out: list[bytes | None] = [None] * len(keys)
        if keys:
            self._fetch_into_list(keys, list(range(len(keys))), out, self._deadline(), use=False)
        return out

    def _fetch_into_list(
        self,
        keys: Sequence[ChunkKey],
        wanted: list[int],
        out: list[bytes | None],
        deadline: float,
        *,
        use: bool = True,
    ) -> None:
        subset = [keys[i] for i in wanted]
        local_plan = self._locate(subset, deadline)
        plan = {e: [wanted[j] for j in idx] for e, idx in local_plan.items()}
        clients = {c.endpoint: c for c in self.clients()}
        targets = [clients[e] for e in plan if e in clients]
        fetched = self._each(
            targets, lambda c: c.fetch([keys[i] for i in plan[c.endpoint]], use=use), deadline
        )
        for client, blobs in zip(targets, fetched):
            if blobs is None:
                continue
            senders = getattr(self._senders, "of", {})
            for i, blob in zip(plan[client.endpoint], blobs):
                out[i] = blob
                if blob is not None:
                    senders[keys[i]] = client.endpoint

    def _judge(self, key: ChunkKey, data: Any) -> Judgement:
        return judge(key, data, mac_key=self.mac_key, expected_fingerprint=self.config.fingerprint)

    def _admit(self, key: ChunkKey, judgement: Judgement) -> bool:
        if judgement.verdict is ReadVerdict.REFUSED:
            # Intact, but not for us (another model, or no valid MAC for our key): a miss,
            # and no reason to delete the peer's copy.
            log.warning("%s: chunk %s refused: %s", self.name, key.hex, judgement.error)
            self.metrics.client_failures.labels("refused_chunk").inc()
        admitted = super()._admit(key, judgement)
        if judgement.verdict is ReadVerdict.CORRUPT:
            self.metrics.client_failures.labels("corrupt").inc()
        return admitted

    def _quarantine(self, key: ChunkKey, reason: str) -> str:
        # A damaged copy at rest must stop being served; if the damage happened in transit
        # (rare: TCP and NIXL check their frames), deleting costs one recompute, nothing more.
        # Only the peer that sent it: the other peers' copies are theirs, and may be intact.
        endpoint = getattr(self._senders, "of", {}).get(key)
        with self._lock:
            if endpoint is None:  # reported from outside a read of ours: where we found it
                endpoint = self._hints.get(key)
            self._hints.pop(key, None)
        sender = next((c for c in self.clients() if c.endpoint == endpoint), None)
        if sender is None:
            return "left (the peer that sent it is gone)"
        try:
            sender.delete([key])
        except PeerError as exc:  # read-only peers keep it; the read is a miss anyway
            return f"left on {endpoint}: {exc}"
        return f"deleted from {endpoint}"

    def get_into(self, key: ChunkKey, buffer: Buffer) -> int | None:
        """Fetch one chunk into ``buffer``, a host-pool slot, and verify it.

        Returns its size, or ``None``.

        Over NIXL, a buffer in memory given to :meth:`register_memory` is written
        by the transfer itself, without a staging copy."""
        return self.get_many_into([key], [buffer])[0]

    def get_many_into(
        self, keys: Sequence[ChunkKey], buffers: Sequence[Buffer]
    ) -> list[int | None]:
        """Batched :meth:`get_into`: one request per peer for all its keys.
        Returns the size per key, or ``None`` if missing, unreachable or failing verification."""
        if len(keys) != len(buffers):
            raise ConfigError("get_many_into needs one buffer per key")
        out: list[int | None] = [None] * len(keys)
        if not keys:
            return out
        deadline = self._deadline()
        plan = self._locate(keys, deadline)
        clients = {c.endpoint: c for c in self.clients()}
        targets = [clients[e] for e in plan if e in clients]

        def fetch(client: PeerClient) -> list[int | None]:
            idx = plan[client.endpoint]
            return client.fetch_into([keys[i] for i in idx], [buffers[i] for i in idx])

        self._senders.of = {}
        for client, sizes in zip(targets, self._each(targets, fetch, deadline)):
            if sizes is None:
                continue
            for i, size in zip(plan[client.endpoint], sizes):
                if size is None:
                    continue
                self._senders.of[keys[i]] = client.endpoint
                view = memoryview(buffers[i]).cast("B")[:size]
                if self._checked(keys[i], view) is not None:
                    out[i] = size
        return out

    def register_memory(self, buffer: Buffer) -> bool:
        """Register a host pool with NIXL, so that :meth:`get_into` reads straight into it.
        False when NIXL is not in use."""
        nixl = self._shared_nixl()
        if nixl is None:
            return False
        nixl.endpoint.register(buffer)
        return True

    # --- writes --------------------------------------------------------------------------

    def _peer_stats(self, client: PeerClient) -> dict[str, Any]:
        now = time.monotonic()
        cached = self._stats_cache.get(client.endpoint)
        if cached is not None and now - cached[0] < self.stats_ttl_s:
            return cached[1]
        stats = client.stats()
        self._stats_cache[client.endpoint] = (now, stats)
        return stats

    def push_targets(self) -> list[PeerClient]:
        """Writable peers, the one with the most free capacity first (unknown capacity last)."""
        clients = self.clients()
        stats = self._each(clients, self._peer_stats)
        ranked = []
        for client, st in zip(clients, stats):
            if st is None or st.get("read_only"):
                continue
            capacity, used = st.get("capacity_bytes"), st.get("used_bytes")
            free = capacity - used if isinstance(capacity, int) and isinstance(used, int) else -1
            ranked.append((free, client))
        ranked.sort(key=lambda pair: pair[0], reverse=True)
        return [client for _, client in ranked]

    def _push(self, items: Sequence[tuple[ChunkKey, Buffer]], overwrite: bool) -> list[bool]:
        """Offer chunks to peers, emptiest first, until one holds each.
        With overwrite it returns per chunk whether a peer holds it now.
        Otherwise it returns whether this call wrote it, as put_if_absent does."""
        out = [False] * len(items)
        remaining = list(range(len(items)))
        for client in self.push_targets():
            if not remaining:
                break
            try:
                results = client.push_detailed([items[i] for i in remaining], overwrite=overwrite)
            except (PeerError, PeerRefused) as exc:
                log.info("push to %s failed: %s", client.endpoint, exc)
                continue
            held = [i for i, (stored, _) in zip(remaining, results) if stored]
            for i, (stored, written) in zip(remaining, results):
                out[i] = stored if overwrite else written
            self._hint([items[i][0] for i in held], client.endpoint)
            remaining = [i for i, (stored, _) in zip(remaining, results) if not stored]
        return out

    def put_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        """Push chunks to the emptiest writable peer, overwriting. True where a peer took one."""
        return self._push(items, overwrite=True)

    def put_if_absent_many(self, items: Sequence[tuple[ChunkKey, Buffer]]) -> list[bool]:
        """Push chunks no peer holds yet. True per chunk this call stored."""
        if not items:
            return []
        present = self.exists_many([k for k, _ in items])
        todo = [i for i, here in enumerate(present) if not here]
        stored = self._push([items[i] for i in todo], overwrite=False) if todo else []
        out = [False] * len(items)
        for i, ok in zip(todo, stored):
            out[i] = ok
        return out

    def delete_many(self, keys: Sequence[ChunkKey]) -> int:
        """Delete keys on every peer. Returns how many keys were held by at least one."""
        if not keys:
            return 0
        clients = self.clients()
        answers = self._each(clients, lambda c: c.delete(keys))
        gone = [False] * len(keys)
        for answer in answers:
            if answer is not None:
                gone = [a or b for a, b in zip(gone, answer)]
        with self._lock:
            for key in keys:
                self._hints.pop(key, None)
        return sum(gone)

    def list(self, namespace: str | None = None) -> Iterator[ChunkInfo]:
        """Every chunk on any live peer, once each."""
        seen: set[ChunkKey] = set()
        for client in self.clients():
            try:
                for info in client.list(namespace):
                    if info.key not in seen:
                        seen.add(info.key)
                        yield info
            except PeerError as exc:
                log.info("peer %s: %s", client.endpoint, exc)

    def stats(self) -> dict[str, dict[str, Any] | None]:
        """Each peer's ``stats`` (``None`` for unreachable peers)."""
        clients = self.clients()
        return {c.endpoint: s for c, s in zip(clients, self._each(clients, lambda c: c.stats()))}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            clients += self._retiring  # closing twice is harmless; never closed is a leak
        for client in clients:
            client.close()
        if self._nixl is not None:
            self._nixl.close()
            self._nixl = None

    def __repr__(self) -> str:
        return f"PeerStore(name={self.name!r}, source={self.source!r})"


def open_peer_store(url: str, **options: Any) -> PeerStore:
    """Open a peer store by URL. ``open_store`` uses this factory for these schemes.
    ``peer://host:port[,host:port...]`` names a static list.
    ``peer+redis://host:port/db`` or ``peer+file:///dir`` names a registry."""
    from chunkstore.peer._discovery import open_registry

    scheme, rest = url.split("://", 1)
    config_fields = set(PeerClientConfig.__dataclass_fields__)
    store_options = {k: v for k, v in options.items() if k not in config_fields}
    client_options = {k: v for k, v in options.items() if k in config_fields}
    for name in ("fingerprint", "curve_server_key", "curve_public_key", "curve_secret_key"):
        value = client_options.get(name)
        if isinstance(value, str) and name != "fingerprint":
            client_options[name] = value.encode()
        elif isinstance(value, str):
            try:
                client_options[name] = bytes.fromhex(value)
            except ValueError:
                raise ConfigError(f"{url}: fingerprint must be hex digits, got {value!r}") from None
    config = PeerClientConfig(**client_options)
    if scheme == "peer":
        endpoints = [e for e in rest.strip("/").split(",") if e]
        if not endpoints:
            raise ConfigError("peer:// needs at least one host:port")
        return PeerStore(endpoints, config, **store_options)
    if scheme == "peer+redis":
        return PeerStore(open_registry(f"redis://{rest}"), config, **store_options)
    if scheme == "peer+file":
        return PeerStore(open_registry(rest), config, **store_options)
    raise ConfigError(f"unknown peer URL scheme {scheme!r}")


__all__ = ["PeerStore", "open_peer_store", "PLANE_INLINE", "PLANE_NIXL"]
