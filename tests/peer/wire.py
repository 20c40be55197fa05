"""Raw protocol messages for the hostile-input tests: a bare DEALER, no PeerClient rules."""

from __future__ import annotations

from typing import Any

import msgpack
import zmq


def raw_request(endpoint: str, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes] | None:
    """Send frames from a bare DEALER and return the reply frames (None on timeout)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout_ms):
            return None
        return sock.recv_multipart()
    finally:
        sock.close(0)


def reply_of(frames: list[bytes] | None) -> dict[str, Any]:
    """The decoded body of a reply (fails the test when there was none)."""
    assert frames is not None, "no reply"
    body: dict[str, Any] = msgpack.unpackb(frames[0], raw=False)
    return body


def hello_body(**fields: Any) -> dict[str, Any]:
    """A valid ``hello`` request body; ``fields`` replace or add fields."""
    return {
        "v": 1,
        "id": 1,
        "op": "hello",
        "versions": [1],
        "client": "hostile-test",
        "fingerprint": None,
        "chunk_tokens": None,
        "planes": ["inline"],
        "nixl_md": None,
        **fields,
    }


class Dealer:
    """One DEALER connection sending many requests (a single client identity)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, body: dict[str, Any], timeout_ms: int = 5000) -> dict[str, Any]:
        """Send one unauthenticated request and wait for its reply."""
        self.sock.send_multipart([msgpack.packb(body, use_bin_type=True), b""])
        assert self.sock.poll(timeout_ms), "no reply"
        return reply_of(self.sock.recv_multipart())

    def close(self) -> None:
        self.sock.close(0)
