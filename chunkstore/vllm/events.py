"""vLLM KV events for what chunkstore holds: ``BlockStored`` / ``BlockRemoved`` per chunk.

The connector's scheduler side owns one :class:`ConnectorEvents`. The tiered
store reports to it through :meth:`~chunkstore.tiering.TieredStore.watch`. It
reports chunks that host memory published or dropped. It also reports chunks
that write-back stored in a tier. The scheduler plans saves and prefetches.
It then tells the events which vLLM block hashes a chunk key stands for.
:meth:`ConnectorEvents.take` joins the two. vLLM's scheduler publishes the
result with its own GPU events, through ``ChunkStoreConnector.take_events``.
So ``--kv-events-config`` works unchanged.

Rules:

* A chunk in host memory is ``medium="CPU"``, ``locality="LOCAL"``. One stored
  in a filesystem or S3 tier is ``medium="STORAGE"``. ``ownership`` names the tier.
* Removals are announced for host memory only, and only for chunks announced
  before. A shared tier's chunk may still serve other engines. So this engine
  never claims it is gone.
* A peer tier's chunks are the peer's to announce. None are published here.
* A chunk holds every KV cache group's KV for its tokens: each change of it is
  one event per group, under the same block hashes, with that group's
  ``group_idx``. Stores also carry the group's ``kv_cache_spec_kind`` and
  ``kv_cache_spec_sliding_window``, as vLLM's GPU events do.
* Where vLLM hashes finer than its blocks (``hash_block_size`` below the block
  size, as a hybrid model's ``prefix_match_unit`` makes it), a block's hash is
  the last fine hash inside it, as vLLM's own block pool names it.
* Some chunks have vLLM block hashes that are not known. They may be another
  engine's, or have a key forgotten past ``identities``, or come from a request
  whose hashes do not tile its blocks (finer than ``hash_block_size`` says, or
  a ``hash_block_size`` that does not divide the block size). Such chunks are
  counted in :attr:`ConnectorEvents.unmapped`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chunkstore.events import EventBuffer
from chunkstore.hashing import ChunkKey

__all__ = ["ConnectorEvents", "EventGroup", "TierMedium", "event_groups", "tier_mediums"]

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
_REMOTE_KINDS = frozenset({"s3"})
"""Tier kinds whose storage is reached over the network: ``locality="REMOTE"``."""
_SILENT_KINDS = frozenset({"peer"})
"""Tier kinds whose chunks another process announces."""


@dataclass(frozen=True, slots=True)
class TierMedium:
    """How one of chunkstore's tiers is named in vLLM events."""

    medium: str
    """``CPU`` or ``STORAGE``."""
    # A mount may be local or shared.
    locality: str | None
    """``LOCAL``, ``REMOTE``, or None when unknown."""
    ownership: str
    """The tier's name."""
    announces_removals: bool
    """Whether removals from this tier are published; only host memory's are."""


def tier_mediums(host_name: str, tiers: Iterable[Any]) -> dict[str, TierMedium]:
    """Map each tier name to its naming in events, for host memory and ``tiers``."""
    mediums = {host_name: TierMedium(MEDIUM_CPU, "LOCAL", host_name, True)}
    for tier in tiers:
        kind = str(getattr(tier, "kind", ""))
        if kind in _SILENT_KINDS:
            continue
        locality = "REMOTE" if kind in _REMOTE_KINDS else None
        mediums[tier.name] = TierMedium(MEDIUM_STORAGE, locality, tier.name, False)
    return mediums


@dataclass(frozen=True, slots=True)
class EventGroup:
    """How vLLM's events describe one KV cache group."""

    kind: str | None
    """``kv_cache_spec_kind``, e.g. ``full_attention`` or ``sliding_window``."""
    sliding_window: int | None
    """``kv_cache_spec_sliding_window``: the window in tokens, None for full attention."""


SINGLE_GROUP = (EventGroup(None, None),)
"""The groups of a model whose specs are not given: one, described by nothing but its index."""


def event_groups(kv_cache_config: Any) -> tuple[EventGroup, ...]:
    """Each of vLLM's KV cache groups, in ``group_idx`` order, as vLLM's events describe it."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    return tuple(
        EventGroup(
            get_kv_cache_spec_kind(group.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(group.kv_cache_spec),
        )
        for group in kv_cache_config.kv_cache_groups
    )


@dataclass(frozen=True, slots=True)
class _Identity:
    """What vLLM calls one chunk: its blocks' hashes and what went into them."""

    block_hashes: list[Any]
    parent: Any
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    session_id: str | None


class ConnectorEvents:
    """Chunkstore's residency events, as vLLM ``KVCacheEvent`` objects.

    The class is thread-safe.

    ``mediums`` maps tier names; see :func:`tier_mediums`. Events of other
    tiers are ignored. At most ``capacity`` events wait between two
    :meth:`take` calls. Older ones are dropped and counted. At most
    ``identities`` chunk keys are remembered. ``groups`` are the engine's KV
    cache groups (see :func:`event_groups`); one event per group stands for a
    chunk's change. ``hash_block_size`` is the token span of one of
    ``request.block_hashes`` (vLLM's ``kv_cache_config.hash_block_size``; None:
    ``block_size``). Where it does not divide ``block_size``, no chunk is mapped.
    """

    def __init__(
        self,
        *,
        block_size: int,
        blocks_per_chunk: int,
        mediums: Mapping[str, TierMedium],
        capacity: int = 65536,
        identities: int = 65536,
        groups: Sequence[EventGroup] = SINGLE_GROUP,
        hash_block_size: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size
        # Fine hashes a block; None where they do not tile the blocks: nothing maps.
        self._step: int | None = None
        if 0 < self.hash_block_size <= block_size and block_size % self.hash_block_size == 0:
            self._step = block_size // self.hash_block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.mediums = dict(mediums)
        self.buffer = EventBuffer(capacity)
        """The listener that receives the tiered store's calls."""
        self.identities = identities
        self.groups = tuple(groups) or SINGLE_GROUP
        self.unmapped = 0
        """Events not published because the chunk's vLLM block hashes were not known."""
        self._ids: OrderedDict[ChunkKey, _Identity] = OrderedDict()
        self._held: dict[ChunkKey, set[str]] = {}
        """Per chunk, the removal-announcing tiers that published its store."""
        self._lock = threading.Lock()

    # --- what the scheduler tells ------------------------------------------------------

    def remember(self, request: Any, first: int, keys: Sequence[ChunkKey]) -> None:
        """Note the vLLM block hashes of ``keys``, so that events can name the blocks.

        ``keys`` are the request's chunks ``first``, ``first + 1`` and so on.
        """
        bpc, bs = self.blocks_per_chunk, self.block_size
        if self._step is None:
            return
        if len(request.block_hashes) * self.hash_block_size > request.num_tokens + bs:
            return  # hashes finer than hash_block_size says: no view of the blocks, unmapped
        from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize

        # One hash per block, the last fine one inside it, as vLLM's block pool reads them.
        hashes = BlockHashListWithBlockSize(request.block_hashes, self.hash_block_size, bs)
        for j, key in enumerate(keys):
            index = first + j
            with self._lock:
                if key in self._ids:
                    self._ids.move_to_end(key)
                    continue
            if len(hashes) < (index + 1) * bpc:
                return
            identity = _identity(request, hashes, index, bpc, bs)
            with self._lock:
                self._ids[key] = identity
                while len(self._ids) > self.identities:
                    old, _ = self._ids.popitem(last=False)
                    self._held.pop(old, None)

    # --- what vLLM publishes ------------------------------------------------------------

    def take(self) -> list[Any]:
        """vLLM events for everything that changed since the last call, oldest first."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        out: list[Any] = []
        for event in self.buffer.take():
            tier = self.mediums.get(event.where)
            if tier is None:
                continue
            with self._lock:
                identity = self._ids.get(event.key)
                if identity is None:
                    if event.stored:
                        self.unmapped += 1
                    continue
                held = self._held.get(event.key)
                if event.stored:
                    if tier.announces_removals:
                        if held is not None and tier.ownership in held:
                            continue  # a replaced copy: announced already
                        self._held.setdefault(event.key, set()).add(tier.ownership)
                elif held is None or tier.ownership not in held:
                    continue
                else:
                    held.discard(tier.ownership)
                    if not held:
                        del self._held[event.key]
            for group_idx, group in enumerate(self.groups):
                if event.stored:
                    out.append(
                        BlockStored(
                            block_hashes=list(identity.block_hashes),
                            parent_block_hash=identity.parent,
                            token_ids=list(identity.token_ids),
                            block_size=self.block_size,
                            lora_id=identity.lora_id,
                            medium=tier.medium,
                            lora_name=identity.lora_name,
                            extra_keys=identity.extra_keys,
                            group_idx=group_idx,
                            kv_cache_spec_kind=group.kind,
                            kv_cache_spec_sliding_window=group.sliding_window,
                            locality=tier.locality,
                            ownership=tier.ownership,
                            session_id=identity.session_id,
                        )
                    )
                else:
                    out.append(
                        BlockRemoved(
                            block_hashes=list(identity.block_hashes),
                            medium=tier.medium,
                            group_idx=group_idx,
                            locality=tier.locality,
                            ownership=tier.ownership,
                        )
                    )
        return out


def _identity(request: Any, hashes: Any, index: int, bpc: int, bs: int) -> _Identity:
    """Chunk ``index`` of ``request`` as vLLM's block pool describes its blocks; ``hashes``
    holds one hash per block."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    start = index * bpc
    extra = [
        generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, 0)[0]
        for b in range(start, start + bpc)
    ]
    lora = getattr(request, "lora_request", None)
    return _Identity(
        block_hashes=[maybe_convert_block_hash(h) for h in hashes[start : start + bpc]],
        parent=maybe_convert_block_hash(hashes[start - 1]) if start else None,
        token_ids=list(request.all_token_ids[start * bs : (start + bpc) * bs]),
        lora_id=lora.adapter_id if lora is not None else None,
        lora_name=lora.name if lora is not None else None,
        extra_keys=to_event_extra_keys(extra),
        session_id=getattr(request, "session_id", None),
    )
