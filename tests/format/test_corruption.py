"""Damaged input: truncation, bit flips, foreign and empty files -> the right FormatError."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkstore.errors import (
    BadMagic,
    ChecksumMismatch,
    FormatError,
    HeaderTooLarge,
    KeyMismatch,
    LayoutError,
    MalformedHeader,
    TruncatedChunk,
    UnsupportedVersion,
)
from chunkstore.format import ChunkLayout, decode_chunk, key_digest, recompress, seal_chunk
from chunkstore.format._header import render_header
from chunkstore.hashing import namespace_of, namespace_root
from chunkstore.testing.factories import make_chunks, small_spec

LAYOUT = ChunkLayout(small_spec(chunk_tokens=8, num_layers=2, num_kv_heads=2, head_dim=4))
GOOD = make_chunks(LAYOUT, np.arange(8, dtype=np.uint32))[0].data


def _boundaries(data: bytes) -> list[int]:
    """Every field boundary: length prefix, each JSON field, header end, each tensor, the end."""
    header_end = LAYOUT.data_offset
    marks = {0, 1, 7, 8, header_end - 1, header_end, len(data) - 1}
    text = data[8:header_end]
    for token in (b'":"', b'","', b'":{', b"},", b"[", b"]"):
        start = 0
        while (i := text.find(token, start)) >= 0:
            marks.update({8 + i, 8 + i + len(token)})
            start = i + 1
    for slot in LAYOUT.tensors:
        marks.update({header_end + slot.offset, header_end + slot.offset + slot.nbytes // 2})
    return sorted(m for m in marks if 0 <= m < len(data))


@pytest.mark.parametrize("cut", _boundaries(GOOD))
def test_truncation_at_every_field_boundary(cut: int) -> None:
    with pytest.raises(TruncatedChunk):
        decode_chunk(GOOD[:cut])


@given(st.integers(0, len(GOOD) - 1))
def test_truncation_at_random_offsets(cut: int) -> None:
    with pytest.raises(TruncatedChunk):
        decode_chunk(GOOD[:cut])


def test_every_single_bit_flip_in_the_header_is_detected() -> None:
    detected: dict[str, int] = {}
    for byte in range(LAYOUT.data_offset):
        for bit in range(8):
            damaged = bytearray(GOOD)
            damaged[byte] ^= 1 << bit
            with pytest.raises(FormatError) as info:
                decode_chunk(damaged)
            detected[type(info.value).__name__] = detected.get(type(info.value).__name__, 0) + 1
    assert sum(detected.values()) == LAYOUT.data_offset * 8
    assert {"ChecksumMismatch", "MalformedHeader", "BadMagic"} <= set(detected)


def test_every_single_bit_flip_in_the_payload_is_a_checksum_mismatch() -> None:
    for byte in range(LAYOUT.data_offset, len(GOOD)):
        for bit in (0, 3, 7):
            damaged = bytearray(GOOD)
            damaged[byte] ^= 1 << bit
            with pytest.raises(ChecksumMismatch):
                decode_chunk(damaged)


def test_unverified_decode_still_rejects_header_damage() -> None:
    damaged = bytearray(GOOD)
    damaged[9] ^= 0x40
    with pytest.raises(FormatError):
        decode_chunk(damaged, verify=False)


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"", TruncatedChunk),
        (b"\x00" * 3, TruncatedChunk),
        (b"PK\x03\x04" + b"\x00" * 100, BadMagic),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, BadMagic),
        (struct.pack("<Q", 2) + b"{}", BadMagic),
        (b"hello world, this is a text file and no chunk at all\n" * 10, BadMagic),
    ],
    ids=["empty", "tiny", "zip", "png", "plain-safetensors", "text"],
)
def test_foreign_and_empty_files(data: bytes, error: type[FormatError]) -> None:
    with pytest.raises(error):
        decode_chunk(data)


def test_oversized_header_length() -> None:
    damaged = bytearray(GOOD)
    damaged[0:8] = struct.pack("<Q", 1 << 40)
    with pytest.raises(HeaderTooLarge):
        decode_chunk(damaged)


def _rewrite_header(mutate) -> bytes:
    """Re-render GOOD's header after `mutate(meta, tensors)`, with a correct checksum."""
    header_len = struct.unpack_from("<Q", GOOD)[0]
    doc = json.loads(GOOD[8 : 8 + header_len])
    meta = doc.pop("__metadata__")
    tensors = [
        (
            k,
            v["dtype"],
            tuple(v["shape"]),
            v["data_offsets"][0],
            v["data_offsets"][1] - v["data_offsets"][0],
        )
        for k, v in doc.items()
    ]
    mutate(meta, tensors)
    head = render_header(list(meta.items()), tensors, 4096)
    payload = GOOD[LAYOUT.data_offset :]
    import xxhash

    zeroed = head.replace(meta["checksum"].encode(), b"xxh3-128:" + b"0" * 32)
    digest = xxhash.xxh3_128(zeroed + payload).hexdigest()
    return zeroed.replace(b"xxh3-128:" + b"0" * 32, f"xxh3-128:{digest}".encode()) + payload


def test_unknown_major_version_is_unsupported_but_newer_minor_is_read() -> None:
    with pytest.raises(UnsupportedVersion):
        decode_chunk(_rewrite_header(lambda m, t: m.update(chunkstore="2.0")))
    with pytest.raises(UnsupportedVersion):
        decode_chunk(_rewrite_header(lambda m, t: m.update(chunkstore="0.9")))
    chunk = decode_chunk(_rewrite_header(lambda m, t: m.update(chunkstore="1.7")))
    assert chunk.header.version == "1.7"


def test_holes_and_overlaps_in_offsets() -> None:
    def hole(meta, tensors):
        name, dtype, shape, offset, nbytes = tensors[1]
        tensors[1] = (name, dtype, shape, offset + 2, nbytes)

    def overlap(meta, tensors):
        name, dtype, shape, offset, nbytes = tensors[1]
        tensors[1] = (name, dtype, shape, offset - 2, nbytes)

    def wrong_size(meta, tensors):
        name, dtype, shape, offset, nbytes = tensors[0]
        tensors[0] = (name, dtype, shape, offset, nbytes - 2)

    for mutate in (hole, overlap, wrong_size):
        with pytest.raises(LayoutError):
            decode_chunk(_rewrite_header(mutate))


def test_key_not_rederivable_from_parent_and_tokens() -> None:
    def swap_token(meta, tensors):
        meta["tokens"] = "ffffffff" + meta["tokens"][8:]

    with pytest.raises(KeyMismatch):
        decode_chunk(_rewrite_header(swap_token))


def test_bad_fields_are_malformed() -> None:
    for field, value in [
        ("fingerprint", "xyz"),
        ("tokens", "123"),
        ("compression", "lz4"),
        ("payload_size", "-1"),
        ("key", "A" * 64),
    ]:
        with pytest.raises(MalformedHeader):
            decode_chunk(_rewrite_header(lambda m, t, f=field, v=value: m.update({f: v})))


def test_trailing_bytes_after_payload() -> None:
    with pytest.raises(LayoutError):
        decode_chunk(GOOD + b"\x00")


def test_damaged_zstd_payload() -> None:
    packed = bytearray(recompress(GOOD, "zstd"))
    packed[-3] ^= 0xFF
    with pytest.raises(FormatError):
        decode_chunk(packed)
    with pytest.raises(FormatError):
        decode_chunk(packed, verify=False)


def test_seal_then_flip_then_reseal_is_valid_again() -> None:
    """A control: the checks above fail because of the damage, not because of the harness."""
    buf = bytearray(GOOD)
    buf[-1] ^= 1
    root = namespace_root(LAYOUT.fingerprint)
    tokens = np.arange(8, dtype=np.uint32)
    seal_chunk(
        LAYOUT,
        buf,
        key=key_digest(root, tokens),
        parent=root,
        namespace=namespace_of(root),
        tokens=tokens,
    )
    decode_chunk(buf)
    assert (
        decode_chunk(_rewrite_header(lambda m, t: None)).header.key == decode_chunk(GOOD).header.key
    )
