"""vLLM's KV event wire format, as chunkstore writes and reads it."""

from __future__ import annotations

import pytest

from chunkstore.events import (
    EventBatch,
    all_blocks_cleared,
    block_removed,
    block_stored,
    decode_batch,
    encode_batch,
)

BATCH = EventBatch(
    1.5,
    [
        block_stored(
            [b"\x01" * 32, b"\x02" * 32],
            None,
            list(range(32)),
            16,
            "STORAGE",
            lora_name="adapter",
            extra_keys=[("salt",), None],
            locality="REMOTE",
            ownership="shared",
        ),
        block_removed([7, 8], "STORAGE", ownership="shared"),
        all_blocks_cleared(),
    ],
    data_parallel_rank=0,
)


def test_round_trip():
    assert decode_batch(encode_batch(BATCH)) == EventBatch(
        BATCH.ts, [dict(e) for e in BATCH.events], 0
    )


def test_exact_bytes_of_a_small_batch():
    batch = EventBatch(2.0, [block_removed([1], "CPU")])
    # [2.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}]]
    assert encode_batch(batch) == bytes.fromhex(
        "92cb400000000000000091 83a474797065ac426c6f636b52656d6f766564"
        "ac626c6f636b5f68617368657391 01a66d656469756da3435055".replace(" ", "")
    )


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"\x90", b"\x92\xa1x\x90", b"\x92\x01\x91\x81\xa4type\xa3Foo"],
    ids=["not-msgpack", "empty", "bad-ts", "unknown-type"],
)
def test_malformed_payloads_are_value_errors(payload):
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_vllm_decodes_what_chunkstore_writes_byte_for_byte():
    pytest.importorskip("vllm")
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    decoded = msgspec.msgpack.decode(encode_batch(BATCH), type=KVEventBatch)
    stored, removed, cleared = decoded.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == [b"\x01" * 32, b"\x02" * 32]
    assert stored.parent_block_hash is None and stored.block_size == 16
    assert stored.medium == "STORAGE" and stored.ownership == "shared"
    assert stored.extra_keys == [("salt",), None] and stored.lora_name == "adapter"
    assert removed.block_hashes == [7, 8] and removed.medium == "STORAGE"
    assert decoded.data_parallel_rank == 0
    # vLLM's encoder writes the same bytes, and chunkstore reads vLLM's.
    assert msgspec.msgpack.encode(decoded) == encode_batch(BATCH)
