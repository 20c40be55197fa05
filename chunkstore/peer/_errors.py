"""Errors of the peer protocol (all subclass :mod:`chunkstore.errors` classes)."""

from __future__ import annotations

from chunkstore.errors import ChunkStoreError, StoreError


class PeerError(StoreError):
    """A peer could not be reached or refused a request."""


class PeerUnavailable(PeerError):
    """The peer did not answer within the timeout, or is marked down after a failure."""


class PeerRefused(PeerError):
    """The peer answered with a protocol error, about version, fingerprint, auth or limits.

    ``code`` is the error code of spec/PROTOCOL.md ("fingerprint_mismatch", ...).
    """

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"peer refused: {code}: {reason}")
        self.code = code
        self.reason = reason


class ProtocolViolation(ChunkStoreError):
    """A received message breaks spec/PROTOCOL.md (malformed, oversized, bad MAC).

    ``code`` is the error code the server replies with.
    """

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
