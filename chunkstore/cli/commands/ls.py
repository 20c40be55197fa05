"""``chunkstore ls URL``: list stored chunks with size, age and namespace."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.storeargs import (
    add_output_options,
    add_store_options,
    namespace_arg,
    open_cli_store,
)
from chunkstore.cli.table import render_table
from chunkstore.units import format_age, format_size

if TYPE_CHECKING:
    from chunkstore.backends.base import ChunkInfo

_SORTS = {
    "key": lambda i: (i.key.namespace, i.key.hex),
    "size": lambda i: (-i.size, i.key.namespace, i.key.hex),
    "age": lambda i: (i.mtime, i.key.hex),
    "used": lambda i: (i.atime, i.key.hex),
}

EPILOG = """examples:
  chunkstore ls /mnt/kvcache
  chunkstore ls s3://bucket/kv -o endpoint_url=http://127.0.0.1:9000 --sort used --limit 20
  chunkstore ls /mnt/kvcache --namespace 3f2a9c0d11e4b6a7 --json

AGE is the time since the chunk was written, USED the time since its last read.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``ls`` subcommand."""
    parser = subparsers.add_parser(
        "ls",
        help="list chunks (key, namespace, size, age)",
        description="List the chunks of a store: key, namespace, size, age and last use.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", metavar="URL", help="store: a directory, file://, s3://, fsspec URL")
    parser.add_argument(
        "--namespace", metavar="NS", type=namespace_arg, help="only this namespace (16 hex digits)"
    )
    parser.add_argument(
        "--sort",
        choices=sorted(_SORTS),
        default="key",
        help="order: key (namespace, key; default), size (largest first), "
        "age (oldest write first), used (least recently used first)",
    )
    parser.add_argument("--limit", type=int, metavar="N", help="show at most N chunks")
    add_output_options(parser)
    add_store_options(parser)
    parser.set_defaults(func=run)


def chunk_record(info: ChunkInfo) -> dict[str, Any]:
    """The JSON form of one listed chunk."""
    return {
        "key": info.key.hex,
        "namespace": info.key.namespace,
        "size": info.size,
        "mtime": info.mtime,
        "atime": info.atime,
    }


def run(args: argparse.Namespace) -> int:
    """List, sort and print."""
    with open_cli_store(args.url, args) as store:
        infos = sorted(store.list(args.namespace), key=_SORTS[args.sort])
    total_count = len(infos)
    total_bytes = sum(i.size for i in infos)
    shown = infos if args.limit is None else infos[: max(args.limit, 0)]
    if args.json:
        emit_json(
            {
                "url": args.url,
                "count": total_count,
                "bytes": total_bytes,
                "chunks": [chunk_record(i) for i in shown],
            }
        )
        return 0
    now = time.time()
    rows = [
        [
            i.key.hex,
            i.key.namespace,
            format_size(i.size),
            format_age(now - i.mtime),
            format_age(now - i.atime) if i.atime else "-",
        ]
        for i in shown
    ]
    lines = []
    if rows:
        lines.append(
            render_table(["key", "namespace", "size", "age", "used"], rows, right=[2, 3, 4])
        )
    more = f" (showing {len(shown)})" if len(shown) < total_count else ""
    lines.append(f"{total_count} chunks, {format_size(total_bytes)}{more}")
    emit_text("\n".join(lines))
    return 0
