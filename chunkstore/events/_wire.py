"""vLLM's KV event wire format, written and read without vLLM (msgpack only).

A batch is the msgpack array ``[ts, events, data_parallel_rank]``. Each event
is a map tagged by ``"type"``: ``BlockStored``, ``BlockRemoved`` or
``AllBlocksCleared``; fields left at their defaults are omitted, as vLLM's
``msgspec`` types do. ``vllm.distributed.kv_events.KVEventBatch`` decodes what
:func:`encode_batch` writes, and the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EventBatch",
    "all_blocks_cleared",
    "block_removed",
    "block_stored",
    "decode_batch",
    "encode_batch",
]

MEDIUMS = ("GPU", "CPU", "STORAGE")
"""The media vLLM names (``medium``)."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message."""

    ts: float
    """When the publisher made the batch, by its clock, in seconds since the epoch."""
    events: list[dict[str, Any]]
    """The events, as tagged maps."""
    data_parallel_rank: int | None = None
    """The publishing engine's data-parallel rank, when it says."""


def _msgpack() -> Any:
    try:
        import msgpack
    except ImportError:  # pragma: no cover - an extra not installed
        from chunkstore.errors import ConfigError

        raise ConfigError("KV events need msgpack: pip install 'chunkstore[peer]'") from None
    return msgpack


def _optional(event: dict[str, Any], **fields: Any) -> dict[str, Any]:
    event.update({k: v for k, v in fields.items() if v is not None})
    return event


def block_stored(
    block_hashes: Sequence[bytes | int],
    parent: bytes | int | None,
    token_ids: Sequence[int],
    block_size: int,
    medium: str,
    *,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    group_idx: int | None = None,
    locality: str | None = None,
    ownership: str | None = None,
) -> dict[str, Any]:
    """A ``BlockStored`` event: these consecutive blocks, after ``parent``, are held now."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(block_hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": int(block_size),
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }
    return _optional(
        event,
        extra_keys=list(extra_keys) if extra_keys is not None else None,
        group_idx=group_idx,
        locality=locality,
        ownership=ownership,
    )


def block_removed(
    block_hashes: Sequence[bytes | int],
    medium: str,
    *,
    group_idx: int | None = None,
    locality: str | None = None,
    ownership: str | None = None,
) -> dict[str, Any]:
    """A ``BlockRemoved`` event: these blocks are no longer held in ``medium``."""
    event: dict[str, Any] = {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": medium,
    }
    return _optional(event, group_idx=group_idx, locality=locality, ownership=ownership)


def all_blocks_cleared() -> dict[str, Any]:
    """An ``AllBlocksCleared`` event: forget everything this publisher announced."""
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack bytes vLLM's publisher sends for ``batch``."""
    fields: list[Any] = [float(batch.ts), list(batch.events)]
    if batch.data_parallel_rank is not None:
        fields.append(int(batch.data_parallel_rank))
    return bytes(_msgpack().packb(fields, use_bin_type=True))


def decode_batch(payload: bytes, *, max_events: int = 1_000_000) -> EventBatch:
    """Parse one payload; ``ValueError`` if it is not a batch of known events."""
    try:
        fields = _msgpack().unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - any malformed input is one error
        raise ValueError(f"not msgpack: {exc}") from None
    if not isinstance(fields, list) or not 2 <= len(fields) <= 3:
        raise ValueError("an event batch is [ts, events, data_parallel_rank]")
    ts, events = fields[0], fields[1]
    rank = fields[2] if len(fields) == 3 else None
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise ValueError("an event batch is [ts, events, data_parallel_rank]")
    if len(events) > max_events:
        raise ValueError(f"{len(events)} events in one batch (at most {max_events})")
    for event in events:
        _check_event(event)
    if rank is not None and not isinstance(rank, int):
        raise ValueError("data_parallel_rank must be an integer")
    return EventBatch(float(ts), events, rank)


def _check_event(event: Any) -> None:
    if not isinstance(event, dict):
        raise ValueError("an event is a map")
    kind = event.get("type")
    if kind == "AllBlocksCleared":
        return
    if kind not in ("BlockStored", "BlockRemoved"):
        raise ValueError(f"unknown event type {kind!r}")
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, (bytes, int)) for h in hashes):
        raise ValueError(f"{kind}: block_hashes must be a list of bytes or integers")
    if kind == "BlockStored":
        tokens = event.get("token_ids")
        if not isinstance(tokens, list) or not isinstance(event.get("block_size"), int):
            raise ValueError("BlockStored: token_ids and block_size are required")
        extra = event.get("extra_keys")
        if isinstance(extra, list):  # msgpack has no tuples: vLLM's are tuples
            event["extra_keys"] = [tuple(k) if isinstance(k, list) else k for k in extra]
