"""Mapping from vLLM's offload keys to chunkstore keys, through the request's checked tokens.

vLLM's tier API hands a secondary tier an ``OffloadKey`` and a ``ReqContext``.
The ``OffloadKey`` is vLLM's block hash of the chunk's last block and a group
index. The ``ReqContext`` is the request id and the key's end-token position.
Neither has tokens or salts. A chunkstore key is BLAKE3 over the tokens under a
namespace root. The root covers the model fingerprint, LoRA, ``cache_salt`` and
multimodal hashes. A chunk also carries its tokens. So the tier needs the
request itself. The choice, and why it is sound:

* vLLM announces every request to the tier in ``on_new_request``. The caller
  is ``OffloadingConnectorScheduler.on_new_request(request)`` or its
  ``request_finished``, in the scheduler process. :func:`caller_request`
  takes the ``Request`` object from that caller's frame. It matches by
  ``request_id``. The tier keeps the request until ``on_request_finished``.
* Each key is checked against vLLM's own hash chain before use.
  ``request.block_hashes[end // tokens_per_hash - 1]`` must equal the
  offload key's block hash. A key that does not match is a miss or a skipped
  store. It never yields a chunk under the wrong tokens. Another process's
  request can produce such a key. So can a future vLLM that stops calling the
  tier this way.
* The namespace root comes from :meth:`~chunkstore.vllm.engine.EngineKV.root_of`.
  The connector uses the same function. So both paths name a chunk alike.

:func:`caller_engine` finds the engine's description the same way. It runs once,
when vLLM builds the tier inside ``OffloadingConnectorScheduler.__init__``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from chunkstore.hashing import ChunkKey
from chunkstore.vllm.engine import EngineKV

__all__ = ["ChunkAddress", "RequestKeys", "caller_engine", "caller_request"]

# vLLM's callers are a few frames up.
_MAX_FRAMES = 32
"""How many frames up the call stack the probes look."""


def caller_request(req_id: str) -> Any | None:
    """The vLLM ``Request`` named ``req_id``, from a caller frame's local ``request``."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        candidate = frame.f_locals.get("request")
        if getattr(candidate, "request_id", None) == req_id and hasattr(candidate, "all_token_ids"):
            return candidate
        frame = frame.f_back
    return None


def caller_engine() -> tuple[Any, Any] | None:
    """The ``(vllm_config, kv_cache_config)`` of the connector being built up the stack."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        local = frame.f_locals
        config, kv_cache_config = local.get("vllm_config"), local.get("kv_cache_config")
        if config is not None and hasattr(kv_cache_config, "kv_cache_groups"):
            return config, kv_cache_config
        frame = frame.f_back
    return None


@dataclass(frozen=True, slots=True)
class ChunkAddress:
    """What storing or finding one chunk needs."""

    key: ChunkKey
    """The chunkstore key, the same as the connector's key for these tokens."""
    parent: bytes
    """Parent digest: the previous chunk's key, or the namespace root."""
    tokens: tuple[int, ...]
    """The chunk's tokens."""


@dataclass
class _Tracked:
    request: Any
    root: bytes
    keys: list[ChunkKey] = field(default_factory=list)


class RequestKeys:
    """Chunkstore keys for the offload keys of live requests.

    The class is not thread-safe. vLLM calls the tier under its manager lock.
    """

    def __init__(
        self,
        engine: EngineKV,
        *,
        tokens_per_hash: int,
        block_hash_of: Callable[[Any], bytes],
    ) -> None:
        self.engine = engine
        self.tokens_per_hash = tokens_per_hash
        self._block_hash_of = block_hash_of
        self._requests: dict[str, _Tracked] = {}
        self.unmatched = 0
        """Number of offload keys not tied to tokens; each became a miss or a skipped store."""

    def track(self, req_id: str, request: Any) -> None:
        """Remember the vLLM ``Request`` ``request`` until :meth:`forget`."""
        self._requests[req_id] = _Tracked(request, self.engine.root_of(request))

    def forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def address(
        self, req_id: str, offload_key: bytes, end_token: int | None
    ) -> ChunkAddress | None:
        """The chunk that ends at token ``end_token`` of request ``req_id``.

        Returns None unless ``offload_key`` is vLLM's hash of exactly those
        tokens.
        """
        tracked = self._requests.get(req_id)
        c = self.engine.chunk_tokens
        if tracked is None or end_token is None or end_token <= 0 or end_token % c:
            self.unmatched += 1
            return None
        request = tracked.request
        hashes = request.block_hashes
        h = end_token // self.tokens_per_hash - 1
        tokens = request.all_token_ids
        if (
            h >= len(hashes)
            or hashes[h] != self._block_hash_of(offload_key)
            or len(tokens) < end_token
        ):
            self.unmatched += 1
            return None
        index = end_token // c - 1
        done = len(tracked.keys)
        if index >= done:
            # Go on from the last key. A request stored over many jobs then hashes each chunk
            # once, not its whole prefix per job. This runs on the scheduler thread.
            after = tracked.keys[-1] if done else None
            tracked.keys += self.engine.keys(tokens[done * c : end_token], tracked.root, after)
        parent = tracked.keys[index - 1].digest if index else tracked.root
        return ChunkAddress(tracked.keys[index], parent, tuple(tokens[index * c : end_token]))
