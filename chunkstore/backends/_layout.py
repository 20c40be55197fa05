"""Names inside a store root (spec/FORMAT.md, "Store layout"): shared by the fs and S3 stores.

::

    <root>/chunkstore-layout.json             layout version marker
    <root>/<namespace>/ab/cd/<hex>.kvc        one chunk (ChunkKey.path)
    <root>/<namespace>/ab/cd/<hex>.kvc.atime  optional access record (decimal seconds)
    <root>/<namespace>/ab/cd/.<hex>.<pid>.<rand>.tmp   a write in progress (or an orphan)
    <root>/quarantine/<namespace>/<hex>.kvc   corrupt chunks moved aside (+ ``.reason``)
    <root>/quarantine/<namespace>/.<hex>.<pid>.<rand>.tmp   one on its way there
    <root>/.chunkstore/                       lock file and usage ledger (capacity)
    <root>/.chunkstore/.<hex>.<pid>.<rand>.tmp   a corrupt chunk being deleted
    <root>/.chunkstore/models/<fp>.json       model record: which model a fingerprint names
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from enum import Enum

from chunkstore.errors import StoreError

LAYOUT_VERSION = 1
"""The store layout this code writes; readers accept :data:`READABLE_LAYOUTS`."""
READABLE_LAYOUTS = (1,)
MARKER_NAME = "chunkstore-layout.json"
QUARANTINE_DIR = "quarantine"
STATE_DIR = ".chunkstore"
CHUNK_SUFFIX = ".kvc"
ACCESS_SUFFIX = ".kvc.atime"
REASON_SUFFIX = ".reason"
TEMP_SUFFIX = ".tmp"

FANOUT_RE = re.compile(r"[0-9a-f]{2}")
_CHUNK_RE = re.compile(r"[0-9a-f]{64}\.kvc")
_ACCESS_RE = re.compile(r"[0-9a-f]{64}\.kvc\.atime")
_TEMP_RE = re.compile(r"\..+\.tmp")
# Exactly what temp_name() makes of a chunk's hex: a set-aside's staged file (the state
# directory's ledger and model-record temps and a note's temp are named after other names).
_STAGED_RE = re.compile(r"\.([0-9a-f]{64})\.[0-9]+\.[0-9a-f]{12}\.tmp")


class FileKind(str, Enum):
    """What a file in a fan-out directory is (spec/FORMAT.md 6.1)."""

    CHUNK = "chunk"
    """``<hex>.kvc``: a chunk."""
    ACCESS = "access"
    """``<hex>.kvc.atime``: a chunk's access record."""
    TEMP = "temp"
    """``.<hex>.<pid>.<rand>.tmp``: a write in progress, or its orphan."""
    FOREIGN = "foreign"
    """Anything else: not chunkstore's (reported, never touched)."""

    __str__ = str.__str__  # the plain value in messages, on every Python version


CHUNK = FileKind.CHUNK
ACCESS = FileKind.ACCESS
TEMP = FileKind.TEMP
FOREIGN = FileKind.FOREIGN


def model_record_name(fingerprint: bytes) -> str:
    """Where, relative to the root, the record of the model with ``fingerprint`` lives."""
    return f"{STATE_DIR}/models/{fingerprint.hex()}.json"


def classify(name: str) -> FileKind:
    """What a file name inside a fan-out directory is: chunk, access record, temp or foreign."""
    if _CHUNK_RE.fullmatch(name):
        return CHUNK
    if _ACCESS_RE.fullmatch(name):
        return ACCESS
    if _TEMP_RE.fullmatch(name):
        return TEMP
    return FOREIGN


def staged_hex(name: str) -> str | None:
    """The chunk hex in a set-aside's staged temp name, or None for any other name.
    That name is :func:`temp_name` of a chunk's hex."""
    match = _STAGED_RE.fullmatch(name)
    return match.group(1) if match else None


def temp_name(hex_digest: str) -> str:
    """A temp file name no other writer (process, thread, host) will pick."""
    return f".{hex_digest}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}"


def marker_bytes() -> bytes:
    """Contents of a new layout marker."""
    doc = {
        "layout": LAYOUT_VERSION,
        "format": "chunkstore",
        "created": round(time.time(), 3),
        "path": "<namespace>/<ab>/<cd>/<hex>.kvc",
        # Names the store in a capacity index (spec 6.8): two stores made in the same
        # millisecond must not share one.
        "id": secrets.token_hex(16),
    }
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def check_marker(data: bytes, where: str) -> int:
    """The layout version in a marker; StoreError if unreadable or unsupported."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        doc = None
    version = doc.get("layout") if isinstance(doc, dict) else None
    if type(version) is not int:  # 1, never "1", 1.5 or true (spec 6.2)
        raise StoreError(f"{where}: {MARKER_NAME} is not a chunkstore layout marker")
    if version not in READABLE_LAYOUTS:
        raise StoreError(
            f"{where}: store layout {version} is not supported by this chunkstore "
            f"(reads {', '.join(map(str, READABLE_LAYOUTS))}); upgrade chunkstore"
        )
    return version


_ACCESS_TIME_RE = re.compile(rb"\s*([0-9]{1,18}(\.[0-9]{1,9})?)\s*")


def parse_access(data: bytes | None) -> float:
    """The time in an access record, in ASCII decimal seconds, see spec 6.5.
    0 for a missing, torn or unparsable one.
    Only decimals count. float() also took ``inf`` and ``1e300``.
    Those made their chunk the most recently used forever, never pruned or evicted."""
    match = _ACCESS_TIME_RE.fullmatch(data or b"")
    return float(match.group(1)) if match else 0.0


def access_bytes(now: float) -> bytes:
    """Contents of an access record."""
    return f"{now:.3f}".encode()
