"""Judging stored bytes: ok, corrupt, or written by a format version this reader lacks.

``verify`` and ``cp`` both need the distinction: a chunk of an unknown major
version, or of a newer minor using a dtype or compression this reader lacks (a
newer writer during a rolling upgrade), is not damage and must not be
quarantined or deleted, only reported (spec/FORMAT.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkstore.errors import FormatError, UnsupportedVersion
from chunkstore.format import decode_chunk
from chunkstore.hashing import ChunkKey

OK = "ok"
CORRUPT = "corrupt"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What decoding one stored chunk said."""

    status: str
    """``ok``, ``corrupt`` or ``unsupported``."""
    problem: str = ""
    """``ErrorClass: message`` when not ok."""


def judge(data: Any, key: ChunkKey) -> Verdict:
    """Decode with checksum verification and check the key and namespace it was stored under."""
    try:
        chunk = decode_chunk(data, verify=True, expected_key=key.digest)
    except UnsupportedVersion as exc:  # also what a newer minor added (UnknownDType, ...)
        return Verdict(UNSUPPORTED, f"{type(exc).__name__}: {exc}")
    except FormatError as exc:
        return Verdict(CORRUPT, f"{type(exc).__name__}: {exc}")
    if chunk.header.namespace != key.namespace:
        return Verdict(
            CORRUPT,
            f"NamespaceMismatch: chunk of namespace {chunk.header.namespace} "
            f"stored under {key.namespace}",
        )
    return Verdict(OK)
