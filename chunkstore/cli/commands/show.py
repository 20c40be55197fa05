"""``chunkstore show``: one chunk's header, tensor table, tokens, checksum and key checks."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.cli.exitcodes import FAILURE, OK
from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.storeargs import add_output_options, add_store_options, open_cli_store
from chunkstore.cli.table import render_fields, render_table
from chunkstore.errors import (
    ChecksumMismatch,
    ConfigError,
    FormatError,
    KeyMismatch,
    StoreError,
)
from chunkstore.units import format_size

if TYPE_CHECKING:
    from chunkstore.backends.base import Store
    from chunkstore.format import ChunkHeader
    from chunkstore.hashing import ChunkKey

_KEY_ARG = re.compile(r"(?:([0-9a-f]{16})/)?([0-9a-f]{4,64})")
_CHUNK_NAME = re.compile(r"([0-9a-f]{64})\.kvc")
_TOKENS_PER_LINE = 16

EPILOG = """examples:
  chunkstore show /mnt/kvcache/3f2a9c0d11e4b6a7/ab/cd/abcd...kvc
  chunkstore show /mnt/kvcache abcd1234           (a unique key prefix, 4+ hex digits)
  chunkstore show s3://bucket/kv 3f2a9c0d11e4b6a7/abcd...  --json

Exits 1 when the checksum or a key check fails, 5 when the file is not a chunk at all
(or has a format version this chunkstore cannot read).
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``show`` subcommand."""
    parser = subparsers.add_parser(
        "show",
        help="print one chunk: header, tensors, tokens, checksum and key checks",
        description=(
            "Print one chunk: its header fields, tensor table and tokens, and whether its "
            "checksum holds and its key equals BLAKE3(parent || tokens). Give a chunk FILE, "
            "or a store URL and a KEY (64 hex digits, a unique prefix, or NAMESPACE/KEY)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="URL|FILE", help="a chunk file, or a store URL")
    parser.add_argument("key", metavar="KEY", nargs="?", help="chunk key when URL is a store")
    add_output_options(parser)
    add_store_options(parser)
    parser.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Checks:
    """Outcome of the integrity checks on one chunk."""

    payload: str
    """``ok`` or the decoder's complaint about the payload (checksum, size, compression)."""
    checksum: str
    """``ok``, ``MISMATCH`` or ``not checked (...)`` when the payload failed before it."""
    key_derivation: bool
    """Whether the key equals BLAKE3(parent || tokens)."""
    key_expected: bool | None
    """Whether the key equals the one asked for (file name / KEY argument); None if none."""
    namespace_expected: bool | None
    """Whether the header's namespace is the directory it is stored under; None if unknown."""

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return (
            self.payload == "ok"
            and self.key_derivation
            and self.key_expected is not False
            and self.namespace_expected is not False
        )


@dataclass(frozen=True, slots=True)
class Expected:
    """What a chunk should hold, from its file name or the KEY argument."""

    digest: bytes
    """The key digest."""
    namespace: str | None
    """The namespace it is stored under, when known."""


def check_chunk(data: Any, header: ChunkHeader, expected: Expected | None) -> Checks:
    """Run the checks independently, so one failure does not hide the others."""
    from chunkstore.format import decode_chunk, key_digest

    try:
        decode_chunk(data, verify=True)
        payload, checksum = "ok", "ok"
    except ChecksumMismatch:
        payload, checksum = "checksum mismatch", "MISMATCH"
    except KeyMismatch:
        # The decoder checks the key after the checksum, and decompresses after the key.
        checksum = "ok"
        payload = "ok" if header.compression == "none" else "not decompressed (key mismatch)"
    except FormatError as exc:
        payload = f"{type(exc).__name__}: {exc}"
        checksum = f"not checked ({type(exc).__name__})"
    derivation = key_digest(header.parent, header.tokens) == header.key
    if expected is None:
        return Checks(payload, checksum, derivation, None, None)
    return Checks(
        payload,
        checksum,
        derivation,
        expected.digest == header.key,
        None if expected.namespace is None else expected.namespace == header.namespace,
    )


def _find_key(store: Store, text: str) -> ChunkKey:
    from chunkstore.hashing import ChunkKey

    match = _KEY_ARG.fullmatch(text)
    if match is None:
        raise ConfigError(
            f"not a chunk key: {text!r} (64 hex digits, a prefix of 4+, or NAMESPACE/KEY)"
        )
    namespace, digits = match.group(1), match.group(2)
    if namespace and len(digits) == 64:
        return ChunkKey.parse(digits, namespace)
    found = [i.key for i in store.list(namespace) if i.key.hex.startswith(digits)]
    if not found:
        raise StoreError(f"no chunk with key {text} in this store")
    if len(found) > 1:
        listed = ", ".join(f"{k.namespace}/{k.hex[:16]}" for k in sorted(found)[:5])
        raise ConfigError(f"key prefix {text} is ambiguous ({len(found)} chunks: {listed} ...)")
    return found[0]


def _expected_from_path(path: str) -> Expected | None:
    """The key a chunk file must hold, from its name ``<hex>.kvc``, and its namespace from the
    nearest 16-hex directory (``<ns>/ab/cd/`` in a store, ``quarantine/<ns>/``); a file named
    anything else is still showable, with no expectation."""
    from chunkstore.hashing import is_namespace

    name = _CHUNK_NAME.fullmatch(os.path.basename(path))
    if name is None:
        return None
    parts = os.path.abspath(path).split(os.sep)[:-1]
    hexdigits = name.group(1)
    if len(parts) >= 3 and parts[-2:] == [hexdigits[0:2], hexdigits[2:4]]:
        candidate = parts[-3]
    else:
        candidate = parts[-1] if parts else ""
    namespace = candidate if is_namespace(candidate) else None
    return Expected(bytes.fromhex(hexdigits), namespace)


def _load(args: argparse.Namespace) -> tuple[str, bytes, Expected | None]:
    """(what was read, its bytes, the key it should hold if known)."""
    from chunkstore.backends._fsio import LocalIO
    from chunkstore.cli.storeaccess import read_raw_many

    if args.key is None:
        path = args.target
        if os.path.isdir(path):
            raise ConfigError(f"{path} is a directory: give a chunk file, or URL and KEY")
        try:
            # as the store opens chunks (O_NOATIME: looking is not a use): a FIFO, /dev/zero
            # or another non-regular file is refused, not read until it ends (or never)
            whole = LocalIO().read(path)
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc.strerror}") from None
        if whole is None:
            raise StoreError(f"no such file: {path}")
        return path, whole[0], _expected_from_path(path)
    with open_cli_store(args.target, args) as store:
        key = _find_key(store, args.key)
        raw = read_raw_many(store, [key])[0]
    if raw is None:
        raise StoreError(f"chunk {key.namespace}/{key.hex} is not in the store")
    return (
        f"{args.target} {key.namespace}/{key.hex}",
        bytes(raw),
        Expected(key.digest, key.namespace),
    )


def header_record(header: ChunkHeader, size: int) -> dict[str, Any]:
    """The header fields as JSON-friendly values."""
    return {
        "version": header.version,
        "fingerprint": header.fingerprint.hex(),
        "namespace": header.namespace,
        "key": header.key.hex(),
        "parent": header.parent.hex(),
        "compression": header.compression,
        "payload_size": header.payload_size,
        "stored_size": header.stored_size,
        "file_size": size,
        "data_offset": header.data_offset,
        "checksum": "xxh3-128:" + header.checksum.hex(),
        "mac": None if header.mac is None else "blake3-keyed:" + header.mac.hex(),
        "token_count": len(header.tokens),
    }


def _yes_no(value: bool | None, good: str, bad: str, unknown: str) -> str:
    if value is None:
        return f"not checked ({unknown})"
    return good if value else bad


def run(args: argparse.Namespace) -> int:
    """Load the chunk, check it, print it."""
    from chunkstore.format import read_header

    source, data, expected = _load(args)
    try:
        header = read_header(data)
    except FormatError as exc:  # not a chunk at all: exit 5, naming what was read
        raise type(exc)(f"{source}: {exc}") from None
    checks = check_chunk(data, header, expected)
    if args.json:
        emit_json(_document(source, data, header, checks))
    else:
        emit_text(_render(source, data, header, checks))
    return OK if checks.ok else FAILURE


def _document(source: str, data: bytes, header: ChunkHeader, checks: Checks) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "source": source,
        "header": header_record(header, len(data)),
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "offset": t.offset,
                "nbytes": t.nbytes,
            }
            for t in header.tensors
        ],
        "tokens": list(header.tokens),
        "checks": {
            "payload": checks.payload,
            "checksum": checks.checksum,
            "key_derivation": checks.key_derivation,
            "key_expected": checks.key_expected,
            "namespace_expected": checks.namespace_expected,
        },
        "ok": checks.ok,
    }


def _render(source: str, data: bytes, header: ChunkHeader, checks: Checks) -> str:
    """The human report: header fields and checks, the tensor table, the tokens."""
    record = header_record(header, len(data))
    fields = [
        ("source", source),
        ("format", record["version"]),
        ("fingerprint", record["fingerprint"]),
        ("namespace", record["namespace"]),
        ("key", record["key"]),
        ("parent", record["parent"]),
        ("compression", record["compression"]),
        ("payload", f"{record['payload_size']} bytes ({format_size(header.payload_size)})"),
        ("stored", f"{record['stored_size']} bytes at offset {header.data_offset}"),
        ("file", f"{len(data)} bytes"),
        ("mac", record["mac"] or "none"),
        ("checksum", f"{record['checksum']}  {checks.checksum}"),
        ("payload check", checks.payload),
        (
            "key derivation",
            _yes_no(
                checks.key_derivation,
                "ok (BLAKE3(parent || tokens))",
                "FAILED: key is not BLAKE3(parent || tokens)",
                "",
            ),
        ),
        (
            "key expected",
            _yes_no(
                checks.key_expected,
                "ok (matches the requested key)",
                "FAILED: the chunk holds another key than its name",
                "file name is not <key>.kvc",
            ),
        ),
        (
            "namespace check",
            _yes_no(
                checks.namespace_expected,
                "ok (matches its directory)",
                "FAILED: the chunk belongs to another namespace",
                "not stored under a namespace directory",
            ),
        ),
        ("verdict", "OK" if checks.ok else "DAMAGED"),
    ]
    tensor_rows = [
        [t.name, t.dtype, "x".join(str(d) for d in t.shape) or "scalar", t.offset, t.nbytes]
        for t in header.tensors
    ]
    token_lines = [
        " ".join(f"{tok:>6}" for tok in header.tokens[i : i + _TOKENS_PER_LINE])
        for i in range(0, len(header.tokens), _TOKENS_PER_LINE)
    ]
    return "\n".join(
        [
            render_fields(fields),
            "",
            f"tensors ({len(header.tensors)}):",
            render_table(["name", "dtype", "shape", "offset", "bytes"], tensor_rows),
            "",
            f"tokens ({len(header.tokens)}):",
            *token_lines,
        ]
    )
