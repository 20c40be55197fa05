"""A subscriber of KV event batches that notices gaps, replays them and sees restarts.

:class:`EventSubscriber` reads a vLLM-style publisher (vLLM's own or
:class:`~chunkstore.events.EventPublisher`). :class:`PrefixIndex` keeps what
the batches say is held, per publisher and medium, and answers "how many
leading blocks of this request are cached, and where".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chunkstore.events._cacheannouncer import NODE_OWNERSHIP
from chunkstore.events._publisher import END_OF_REPLAY, _zmq
from chunkstore.events._wire import EventBatch, decode_batch

__all__ = ["EventSubscriber", "PrefixIndex", "Received"]

_PUBLISHER_WIDE = (None, "shared", NODE_OWNERSHIP)
"""Ownerships whose blocks ``AllBlocksCleared`` forgets: the publisher speaks only for them
(a shared-store announcer, a node service), not for an engine's own tiers."""


@dataclass(frozen=True, slots=True)
class Received:
    """One batch, in publishing order."""

    seq: int
    """Its sequence number."""
    batch: EventBatch
    """What it says."""
    restarted: bool = False
    """The publisher started again before this batch: forget what it said before."""
    payload: bytes = b""
    """The batch as sent, in msgpack, for decoders of their own."""


class EventSubscriber:
    """Reads batches from ``endpoint``; asks ``replay_endpoint`` for the ones it missed.

    Batches come out of :meth:`receive` once each, in sequence order. Missed
    batches the replay buffer no longer has are counted in :attr:`lost`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
    ) -> None:
        self._zmq = _zmq()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.expected: int | None = None
        """The next sequence number; None before the first batch."""
        self.lost = 0
        """Batches missed that no replay could supply."""
        self.replayed = 0
        """Batches recovered by replay."""
        self.restarts = 0
        """Times the publisher was seen starting again."""
        self._last: tuple[int, bytes] | None = None
        """The last batch delivered: a replay that sends another one under its number comes
        from a restarted publisher."""
        self._caught_up: dict[int, bytes] = {}
        """What :meth:`catch_up` delivered, by seq: the live socket's copies are skipped."""
        self._ctx = self._zmq.Context()
        self._sub: Any = None
        self.connect()

    def connect(self) -> None:
        """(Re)open the subscription; sequence state is kept, so a gap is replayed."""
        zmq = self._zmq
        if self._sub is not None:
            self._sub.close(0)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 1_000_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close(0)
            self._sub = None
        self._ctx.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout: float = 0.1, max_batches: int = 10_000) -> list[Received]:
        """Batches that arrived within ``timeout`` seconds. Those missed are replayed first."""
        out: list[Received] = []
        deadline = time.monotonic() + timeout
        while len(out) < max_batches:
            left = max(0.0, deadline - time.monotonic())
            if not self._sub.poll(int(left * 1000) if not out else 0):
                break
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            self._accept(int.from_bytes(frames[1], "big", signed=True), frames[2], out)
        return out

    def catch_up(self) -> list[Received]:
        """Every batch the publisher still buffers from :attr:`expected` on (from 0 at
        first): what a subscriber that joins late, or slowly, asks for."""
        out: list[Received] = []
        if self.replay_endpoint is None:
            return out
        answers, restarted = self._fetch()
        if restarted:
            self.restarts += 1
            self.expected = 0
        for seq, payload in answers:
            if self.expected is not None:
                self.lost += max(0, seq - self.expected)
            out.append(Received(seq, _decoded(payload), restarted, payload))
            restarted = False
            self.replayed += 1
            self.expected = seq + 1
            self._last = (seq, payload)
            self._caught_up[seq] = payload
        return out

    def _fetch(self) -> tuple[list[tuple[int, bytes]], bool]:
        """Replay from :attr:`expected`. Returns the batches, and whether the publisher
        restarted.

        The replay starts one batch early. The publisher may send another batch under the
        number of the last one delivered. Then it is a new publisher, and its batches from
        0 are the answer. Sequence numbers alone cannot tell a restart from a gap. A
        complete, empty answer also means a new publisher. A publisher that sent the last
        batch delivered still buffers it, or newer ones. One that has not sent as many
        batches yet is a new one.
        """
        start = self.expected or 0
        if self._last is None or start == 0:
            return [a for a in self._request_replay(start)[0] if a[0] >= start], False
        answers, complete = self._request_replay(start - 1)
        last_seq, last_payload = self._last
        if (answers and answers[0][0] == last_seq and answers[0][1] != last_payload) or (
            complete and not answers
        ):
            return self._request_replay(0)[0], True
        return [a for a in answers if a[0] >= start], False

    def _accept(self, seq: int, payload: bytes, out: list[Received]) -> None:
        restarted = False
        if self._caught_up:
            if self._caught_up.get(seq) == payload:
                return  # delivered by catch_up already (a restarted publisher's differs)
            self._caught_up.clear()
        if self.expected is not None:
            if seq < self.expected:
                # Sequence numbers only grow while a publisher lives (replays stop short of
                # the live batch, so none arrives twice): a smaller one is a new publisher.
                restarted = True
                self.restarts += 1
            elif seq > self.expected:
                restarted = self._replay(seq, out)
        out.append(Received(seq, _decoded(payload), restarted, payload))
        self.expected = seq + 1
        self._last = (seq, payload)

    def _replay(self, stop: int, out: list[Received]) -> bool:
        """Fetch the batches before ``stop`` that were missed; count those the publisher no
        longer has. True: the publisher restarted and no replayed batch says so."""
        assert self.expected is not None
        got = self.expected
        restarted = False
        if self.replay_endpoint is not None:
            answers, restarted = self._fetch()
            if restarted:
                self.restarts += 1
                got = 0
            for seq, payload in answers:
                if seq >= stop or seq < got:
                    continue  # from stop on, the live socket delivers them
                self.lost += seq - got
                out.append(Received(seq, _decoded(payload), restarted, payload))
                restarted = False
                self.replayed += 1
                got = seq + 1
                self._last = (seq, payload)
        self.lost += max(0, stop - got)
        return restarted

    def _request_replay(self, start: int) -> tuple[list[tuple[int, bytes]], bool]:
        """The buffered batches from ``start`` on, and whether the answer ended (False: the
        replay socket did not answer in time)."""
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout
            answers: list[tuple[int, bytes]] = []
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    return answers, False
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                if frames[2] == END_OF_REPLAY:
                    return answers, True
                answers.append((int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            sock.close(0)


def _decoded(payload: bytes) -> EventBatch:
    """The batch, or an empty one for a payload that is not a batch. Its number counts."""
    try:
        return decode_batch(payload)
    except ValueError:
        return EventBatch(0.0, [])


class PrefixIndex:
    """What each publisher holds, per medium, by block hash.

    Feed it with :meth:`apply`; ask :meth:`longest_prefix`. A publisher's
    restart forgets everything it said. ``AllBlocksCleared`` forgets what it
    said except blocks of an engine's own tiers. Those were stored with an
    ``ownership`` other than ``shared``. vLLM sends ``AllBlocksCleared`` when it
    resets its GPU prefix cache, which chunkstore's host memory and tiers survive.
    Their removals come as ``BlockRemoved``. The blocks of a shared-store announcer
    (``ownership="shared"``) and of a node service (``ownership="node"``) are
    forgotten. Each sends ``AllBlocksCleared`` when it starts, and a node service
    also when it stops.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], set[Any]] = {}
        self._tiers: set[tuple[str, str]] = set()
        """(publisher, medium) pairs of an engine's own tiers. They survive AllBlocksCleared."""

    def apply(self, source: str, received: Received) -> None:
        """Apply one batch from publisher ``source``."""
        if received.restarted:
            self.clear(source)
        for event in received.batch.events:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                for where in [w for w in self._held if w[0] == source]:
                    if where not in self._tiers:
                        del self._held[where]
                continue
            where = (source, str(event.get("medium") or "GPU"))
            if kind == "BlockStored":
                self._held.setdefault(where, set()).update(event["block_hashes"])
                if event.get("ownership") not in _PUBLISHER_WIDE:
                    self._tiers.add(where)
            else:
                held = self._held.get(where)
                if held is not None:
                    held.difference_update(event["block_hashes"])

    def clear(self, source: str) -> None:
        """Forget what ``source`` announced."""
        for where in [w for w in self._held if w[0] == source]:
            del self._held[where]
            self._tiers.discard(where)

    def holders(self) -> list[tuple[str, str]]:
        """Every (publisher, medium) holding something."""
        return sorted(w for w, held in self._held.items() if held)

    def count(self, source: str, medium: str) -> int:
        """How many blocks ``source`` holds in ``medium``."""
        return len(self._held.get((source, medium), ()))

    def longest_prefix(self, block_hashes: Sequence[Any]) -> list[tuple[int, str, str]]:
        """(leading blocks held, publisher, medium), longest first, for every holder of at
        least the first block."""
        found = []
        for where, held in self._held.items():
            n = 0
            for h in block_hashes:
                if h not in held:
                    break
                n += 1
            if n:
                found.append((n, where[0], where[1]))
        return sorted(found, key=lambda t: (-t[0], t[1], t[2]))
