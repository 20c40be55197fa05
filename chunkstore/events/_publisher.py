"""A ZeroMQ publisher of KV event batches with vLLM's sequence numbers and replay.

The wire is the same as vLLM's ``ZmqEventPublisher``, so the same subscribers
work.

* PUB socket: each batch is three frames ``(topic, seq, payload)``. ``seq`` is
  8 bytes, big-endian, counting from 0 since the publisher started.
* ROUTER replay socket: a request is ``(b"", start_seq)``. The answer is every
  buffered batch with ``seq >= start_seq`` as ``(b"", topic, seq, payload)``.
  Then comes ``(b"", b"", -1 as 8 signed bytes, b"")``.

A subscriber that sees ``seq`` start again from a small number knows the
publisher restarted; the first batch of a chunkstore publisher starts with
``AllBlocksCleared`` for that reason.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from chunkstore.errors import ConfigError
from chunkstore.events._wire import EventBatch, encode_batch

__all__ = ["END_OF_REPLAY", "EventPublisher"]

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
"""The ``seq`` frame that ends a replay answer."""
_POLL_MS = 20


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:  # pragma: no cover - an extra not installed
        raise ConfigError("KV events need pyzmq: pip install 'chunkstore[peer]'") from None
    return zmq


class EventPublisher:
    """Publishes :class:`EventBatch` objects on ``endpoint``, replays from ``replay_endpoint``.

    :meth:`publish` never blocks. Batches queue for the sending thread, at most
    ``max_queue``. Beyond that the oldest queued batch is dropped and counted in
    :attr:`dropped`. It gets no sequence number, so subscribers see no gap. The
    last ``buffer_steps`` sent batches can be replayed. Close with :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        zmq = _zmq()
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: Any = None
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            """Where subscribers connect: the bound address, with the port resolved."""
            self.replay_endpoint: str | None = None
            """Where replay requests go, if any."""
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._close_sockets()
            raise
        self._topic = topic.encode()
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: deque[EventBatch] = deque()
        self._max_queue = max_queue
        self._cond = threading.Condition()
        self._next_seq = 0
        self._in_flight = 0
        self.dropped = 0
        """Batches dropped from a full queue, never sent."""
        self._closing = False
        self._thread = threading.Thread(
            target=self._run, name="chunkstore-events-publisher", daemon=True
        )
        self._thread.start()

    @property
    def sent(self) -> int:
        """Batches sent so far. This is the next one's ``seq``."""
        return self._next_seq

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending; ``RuntimeError`` once closed."""
        with self._cond:
            if self._closing:
                raise RuntimeError("event publisher is closed")
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(batch)
            self._cond.notify()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch was sent; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, up to ``timeout``. Then stop the thread and close the sockets."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the sending thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closing:
                    self._cond.wait(_POLL_MS / 1000)
                batches = list(self._queue)
                self._queue.clear()
                self._in_flight = len(batches)
                closing = self._closing
            for batch in batches:
                self._send(batch)
            with self._cond:
                self._in_flight = 0
                self._cond.notify_all()
            self._serve_replays()
            if closing and not batches:
                return

    def _send(self, batch: EventBatch) -> None:
        payload = encode_batch(batch)
        seq = self._next_seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq, payload))
        self._sent.append((self._next_seq, payload))
        self._next_seq += 1

    def _serve_replays(self) -> None:
        zmq = self._zmq
        if self._replay is None:
            return
        for _ in range(64):  # bounded per turn: publishing goes first
            if not self._replay.poll(0):
                return
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request: ignored
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._sent):
                if seq >= start:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload),
                        flags=zmq.NOBLOCK,
                    )
            self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""), flags=zmq.NOBLOCK)

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()
