"""Model records: which model a fingerprint names, kept beside the chunks.

A chunk carries its model's fingerprint only.
That is the BLAKE3 of the spec's canonical JSON, see spec/FORMAT.md 5.1.
Format 1.0 is frozen, so the model id cannot go into the chunk.
Instead a writer that knows its :class:`~chunkstore.format.KVSpec` leaves one small record
per model in the store.
The record is ``<root>/.chunkstore/models/<fingerprint>.json``.
Its bytes are exactly that canonical JSON.
The record proves itself: a reader trusts it only when its hash is the fingerprint.
So a stale, foreign or damaged record is ignored, never shown as the wrong model.
Stores written before records existed have none, and the model shows as unknown.

Records are outside the chunk directories: listings, ``verify``, ``prune``
and the foreign-file report never see them.
"""

from __future__ import annotations

import json
import logging

import blake3

from chunkstore.backends.base import Store, SupportsModelRecords
from chunkstore.errors import ChunkStoreError, ConfigError
from chunkstore.format import KVSpec

log = logging.getLogger(__name__)

__all__ = ["model_of_record", "read_model", "record_model"]


def record_model(store: Store, spec: KVSpec) -> bool:
    """Leave ``spec``'s record in ``store`` unless a valid one is there; whether one was written.

    Best effort, for writers at start-up: a store without records, or one that
    fails to write, costs the record only (logged), never the chunks.
    """
    if not isinstance(store, SupportsModelRecords):
        return False
    fingerprint = spec.fingerprint()
    try:
        if read_model(store, fingerprint) is not None:
            return False
        store.write_model_record(fingerprint, spec.canonical_json())
    except ChunkStoreError as exc:
        log.warning("%s: model record for %s not written: %s", store.name, spec.model_id, exc)
        return False
    return True


def read_model(store: Store, fingerprint: bytes) -> KVSpec | None:
    """The spec recorded in ``store`` for ``fingerprint``, or ``None`` (no records, no record,
    or one that does not hash to ``fingerprint``)."""
    if not isinstance(store, SupportsModelRecords):
        return None
    record = store.read_model_record(fingerprint)
    return None if record is None else model_of_record(record, fingerprint)


def model_of_record(record: bytes, fingerprint: bytes) -> KVSpec | None:
    """The spec a record holds, if the record is the canonical JSON whose hash is
    ``fingerprint``; else ``None``."""
    if blake3.blake3(record).digest() != fingerprint:
        return None
    try:
        spec = KVSpec.from_dict(json.loads(record))
    except (ValueError, ConfigError):
        return None
    # The hash matched, so this holds unless from_dict and canonical_json disagree.
    return spec if spec.canonical_json() == record else None
