"""The options of a ``ChunkStoreTier`` entry in ``secondary_tiers``, with their meaning.

``type`` and ``module_path`` are not listed. This module imports no vLLM. So
the docs test reads the options anywhere.
"""

from __future__ import annotations

__all__ = ["TIER_OPTIONS"]

TIER_OPTIONS: dict[str, str] = {
    "tiers": "chunkstore store URLs, fastest first ('file:///mnt/kv', '/mnt/kv', "
    "'s3://bucket/prefix', 'peer://host:port'); writes go to all, reads to the first holder.",
    "store_options": "Mapping of URL -> keyword options passed to open_store for that store.",
    "compression": "'none' (default) or 'zstd' for the chunks written.",
    "model_id": "Model name in the namespace (default: the engine's); set it as the "
    "connector's model_id when they differ.",
    "namespace": "Extra namespace string (as the connector's option of that name).",
    "threads": "Threads running stores and loads (default 4, at most 256); at most one "
    "fewer chunk conversions than the cores the process may use run at once (at least one).",
    "tier_timeout": "Seconds a store call may take before the store counts as down (default 30).",
    "retry_after": "Seconds a down store is skipped before it is tried again (default 5).",
    "locality": "vLLM's locality of this tier: 'LOCAL' or 'REMOTE' (default unset).",
    "enable_kv_events": "Announce the chunks this tier stores as KV events (BlockStored, "
    "medium STORAGE), when vLLM's --kv-events-config is on too (default false).",
}
