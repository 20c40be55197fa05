"""Events for routers: which chunks chunkstore holds, as it changes.

* :class:`EventBuffer` collects :class:`ChunkEvent` records from the host cache
  and the tiered store. Any :class:`ChunkListener` can. Engine adapters map
  them onto their engine's events, as :mod:`chunkstore.vllm.events` does.
* :func:`encode_batch` / :func:`decode_batch` write and read vLLM's KV event
  wire format without vLLM. :class:`EventPublisher` sends batches with vLLM's
  sequence numbers and replay socket.
* :class:`EventSubscriber` and :class:`PrefixIndex` are the other end. The
  subscriber replays what it missed. The index answers "longest cached prefix,
  and where".
* :class:`StoreAnnouncer` publishes what shared stores hold, for
  ``chunkstore serve --events``. :class:`ChunkQuery` answers "which of these
  chunks exist".
* :class:`CacheAnnouncer` publishes what one host cache holds as it changes.
  It serves the node service's ``chunkstore serve --node-events``.

pyzmq and msgpack are imported when a publisher, subscriber or codec is used.
"""

from __future__ import annotations

from chunkstore.events._announcer import ChunkQuery, StoreAnnouncer
from chunkstore.events._cacheannouncer import NODE_OWNERSHIP, CacheAnnouncer
from chunkstore.events._publisher import EventPublisher
from chunkstore.events._records import ChunkEvent, ChunkListener, EventBuffer
from chunkstore.events._subscriber import EventSubscriber, PrefixIndex, Received
from chunkstore.events._wire import (
    EventBatch,
    all_blocks_cleared,
    block_removed,
    block_stored,
    decode_batch,
    encode_batch,
)

__all__ = [
    "NODE_OWNERSHIP",
    "CacheAnnouncer",
    "ChunkEvent",
    "ChunkQuery",
    "ChunkListener",
    "EventBatch",
    "EventBuffer",
    "EventPublisher",
    "EventSubscriber",
    "PrefixIndex",
    "Received",
    "StoreAnnouncer",
    "all_blocks_cleared",
    "block_removed",
    "block_stored",
    "decode_batch",
    "encode_batch",
]
