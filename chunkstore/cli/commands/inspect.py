"""``chunkstore inspect URL``: what a store holds, per namespace and model, and what is wrong."""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.cli.exitcodes import FAILURE, OK
from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.progress import Progress
from chunkstore.cli.storeargs import (
    add_output_options,
    add_store_options,
    namespace_arg,
    open_cli_store,
)
from chunkstore.cli.table import render_table
from chunkstore.errors import FormatError
from chunkstore.units import format_size

if TYPE_CHECKING:
    from chunkstore.backends.base import ChunkInfo, Store
    from chunkstore.cli.storeaccess import Stray

AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("< 1h", 3600.0),
    ("1h - 1d", 86400.0),
    ("1d - 7d", 7 * 86400.0),
    ("7d - 30d", 30 * 86400.0),
    (">= 30d", float("inf")),
)
"""Histogram buckets: label and exclusive upper bound in seconds."""

EPILOG = """examples:
  chunkstore inspect /mnt/kvcache
  chunkstore inspect s3://bucket/kv --no-headers --json

Reads each chunk's header (not its payload) to find the model fingerprint and
format version; the model id comes from the store's model records, which writers
leave beside the chunks ("unknown" for stores without one). "Corrupt" here means
an unreadable header or a header whose key does not match the file name;
`chunkstore verify` checks payload checksums.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``inspect`` subcommand."""
    parser = subparsers.add_parser(
        "inspect",
        help="summarise a store: counts, bytes, namespaces, models, ages, orphans, corrupt",
        description=(
            "Summarise a store: chunk count and bytes, breakdown per namespace and per model "
            "(fingerprint and model id), histogram of ages, orphan temp files, foreign files, "
            "corrupt and quarantined chunks."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", metavar="URL", help="store: a directory, file://, s3://, fsspec URL")
    parser.add_argument("--namespace", metavar="NS", type=namespace_arg, help="only this namespace")
    parser.add_argument(
        "--no-headers",
        action="store_true",
        help="do not read chunk headers (faster; no per-model breakdown or corrupt count)",
    )
    add_output_options(parser)
    add_store_options(parser)
    parser.set_defaults(func=run)


@dataclass(slots=True)
class Tally:
    """Chunk count and bytes of one group."""

    chunks: int = 0
    """Chunks."""
    bytes: int = 0
    """Bytes."""
    models: set[str] = field(default_factory=set)
    """Model fingerprints seen (namespace rows) or namespaces seen (model rows)."""
    tokens: Counter[int] = field(default_factory=Counter)
    """Tokens per chunk seen (model rows)."""
    versions: Counter[str] = field(default_factory=Counter)
    """Format versions seen (model rows)."""

    def add(self, size: int) -> None:
        """Count one chunk."""
        self.chunks += 1
        self.bytes += size


@dataclass(frozen=True, slots=True)
class Problem:
    """A chunk whose header could not be read or does not match its name."""

    info: ChunkInfo
    """The chunk as listed."""
    problem: str
    """``ErrorClass: message``."""


def _bucket(age: float) -> str:
    for label, bound in AGE_BUCKETS:
        if age < bound:
            return label
    return AGE_BUCKETS[-1][0]


@dataclass(slots=True)
class Summary:
    """Everything ``inspect`` found in a store."""

    total: Tally = field(default_factory=Tally)
    """All chunks listed."""
    namespaces: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    """Per namespace."""
    models: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    """Per model fingerprint (from the headers)."""
    written: Counter[str] = field(default_factory=Counter)
    """Chunks per age bucket of their write time."""
    used: Counter[str] = field(default_factory=Counter)
    """Chunks per age bucket of their last use."""
    corrupt: list[Problem] = field(default_factory=list)
    """Unreadable headers, or headers that do not match their name."""
    unsupported: list[Problem] = field(default_factory=list)
    """Headers of a format version this reader lacks."""
    unreadable: list[ChunkInfo] = field(default_factory=list)
    """Chunks still there whose header could not be read (EIO, ESTALE, EACCES)."""
    orphans: list[Stray] = field(default_factory=list)
    """Writers' temp files."""
    foreign: list[Stray] = field(default_factory=list)
    """Files chunkstore did not write."""
    quarantined: list[Stray] = field(default_factory=list)
    """Chunks moved aside as corrupt."""
    model_ids: dict[str, str | None] = field(default_factory=dict)
    """Per model fingerprint, the model id the store's record gives (None: no valid record)."""


def run(args: argparse.Namespace) -> int:
    """Scan listing (and headers), then print the summary."""
    with open_cli_store(args.url, args) as store:
        summary = _collect(store, args)
    if args.json:
        emit_json(_document(args, summary))
    else:
        emit_text(_render(args, summary))
    return FAILURE if summary.unreadable else OK


# --- collect -------------------------------------------------------------------------------


def _collect(store: Store, args: argparse.Namespace) -> Summary:
    """List the store (reading each chunk's header unless ``--no-headers``) and its strays."""
    from chunkstore.cli.storeaccess import (
        find_strays,
        quarantined,
        read_error_count,
        stop_access_tracking,
        unreadable_among,
    )

    summary = Summary()
    namespaces, models = summary.namespaces, summary.models
    written, used = summary.written, summary.used
    corrupt, unsupported = summary.corrupt, summary.unsupported
    total = summary.total
    stop_access_tracking(store)
    infos = list(store.list(args.namespace))
    now = time.time()
    with Progress("inspect", len(infos), quiet=args.quiet or args.no_headers) as progress:
        for info in infos:
            total.add(info.size)
            namespaces[info.key.namespace].add(info.size)
            written[_bucket(now - info.mtime)] += 1
            used[_bucket(now - (info.atime or info.mtime))] += 1
            if not args.no_headers:
                errors_before = read_error_count(store)
                _read_header(store, info, namespaces, models, corrupt, unsupported)
                if unreadable_among(store, [info.key], [None], errors_before):
                    summary.unreadable.append(info)
                progress.advance()
    strays = find_strays(store)
    orphans = [shown for _, shown in strays.temps]
    foreign = strays.foreign
    summary.quarantined = quarantined(store)
    summary.model_ids = {fp: _model_id(store, fp) for fp in models}
    if args.namespace is not None:
        foreign = [f for f in foreign if f"{args.namespace}/" in f.path]
        orphans = [f for f in orphans if f"{args.namespace}/" in f.path]
    summary.orphans, summary.foreign = orphans, foreign
    return summary


# --- render --------------------------------------------------------------------------------


def _document(args: argparse.Namespace, summary: Summary) -> dict[str, Any]:
    """The ``--json`` document."""
    total, orphans, foreign = summary.total, summary.orphans, summary.foreign
    written, used = summary.written, summary.used
    corrupt, unsupported = summary.corrupt, summary.unsupported
    ns_rows = sorted(summary.namespaces.items())
    model_rows = sorted(summary.models.items(), key=lambda kv: (-kv[1].bytes, kv[0]))
    return {
        "url": args.url,
        "chunks": total.chunks,
        "bytes": total.bytes,
        "namespaces": [
            {
                "namespace": ns,
                "chunks": t.chunks,
                "bytes": t.bytes,
                "models": sorted(t.models),
            }
            for ns, t in ns_rows
        ],
        "models": None
        if args.no_headers
        else [
            {
                "fingerprint": fp,
                "model_id": summary.model_ids[fp],
                "chunks": t.chunks,
                "bytes": t.bytes,
                "namespaces": sorted(t.models),
                "tokens_per_chunk": sorted(t.tokens),
                "versions": sorted(t.versions),
            }
            for fp, t in model_rows
        ],
        "age_histogram": [
            {"bucket": label, "written": written[label], "used": used[label]}
            for label, _ in AGE_BUCKETS
        ],
        "orphans": {
            "count": len(orphans),
            "bytes": sum(o.size for o in orphans),
            "paths": [o.path for o in orphans],
        },
        "foreign": {"count": len(foreign), "paths": [f.path for f in foreign]},
        "quarantined": len(summary.quarantined),
        "corrupt": None
        if args.no_headers
        else [
            {"key": p.info.key.hex, "namespace": p.info.key.namespace, "problem": p.problem}
            for p in corrupt
        ],
        "unsupported": None
        if args.no_headers
        else [
            {"key": p.info.key.hex, "namespace": p.info.key.namespace, "problem": p.problem}
            for p in unsupported
        ],
        "unreadable": [
            {"key": i.key.hex, "namespace": i.key.namespace} for i in summary.unreadable
        ],
    }


def _render(args: argparse.Namespace, summary: Summary) -> str:
    """The human report: tables per namespace, model and age, then the problem counts."""
    total, orphans, foreign = summary.total, summary.orphans, summary.foreign
    written, used = summary.written, summary.used
    corrupt, unsupported = summary.corrupt, summary.unsupported
    ns_rows = sorted(summary.namespaces.items())
    model_rows = sorted(summary.models.items(), key=lambda kv: (-kv[1].bytes, kv[0]))
    lines = [f"{args.url}: {total.chunks} chunks, {format_size(total.bytes)}", ""]
    if ns_rows:
        lines.append(
            render_table(
                ["namespace", "chunks", "bytes", "models"],
                [
                    [
                        ns,
                        t.chunks,
                        format_size(t.bytes),
                        len(t.models) if not args.no_headers else "-",
                    ]
                    for ns, t in ns_rows
                ],
                right=[1, 2, 3],
            )
        )
        lines.append("")
    if model_rows:
        lines.append(
            render_table(
                [
                    "model fingerprint",
                    "chunks",
                    "bytes",
                    "namespaces",
                    "tokens/chunk",
                    "format",
                    "model",
                ],
                [
                    [
                        fp[:16],
                        t.chunks,
                        format_size(t.bytes),
                        len(t.models),
                        ",".join(map(str, sorted(t.tokens))),
                        ",".join(sorted(t.versions)),
                        summary.model_ids[fp] or "unknown",
                    ]
                    for fp, t in model_rows
                ],
                right=[1, 2, 3, 4],
            )
        )
        lines.append("")
    lines.append(
        render_table(
            ["age", "written", "last used"],
            [[label, written[label], used[label]] for label, _ in AGE_BUCKETS],
        )
    )
    lines.append("")
    lines.append(f"orphan temp files: {len(orphans)} ({format_size(sum(o.size for o in orphans))})")
    lines.append(f"foreign files:     {len(foreign)}")
    lines.append(f"quarantined:       {len(summary.quarantined)}")
    if args.no_headers:
        lines.append("corrupt:           not checked (--no-headers)")
    else:
        lines.append(f"corrupt:           {len(corrupt)} (headers only; `verify` checks payloads)")
        lines.append(
            f"unsupported:       {len(unsupported)} (format version unknown to this reader)"
        )
        for p in (corrupt + unsupported)[:10]:
            lines.append(f"  {p.info.key.namespace}/{p.info.key.hex[:16]}  {p.problem}")
        if summary.unreadable:
            count = len(summary.unreadable)
            lines.append(f"unreadable:        {count} (I/O or permission error; see the log)")
            for info in summary.unreadable[:10]:
                lines.append(f"  {info.key.namespace}/{info.key.hex[:16]}")
    return "\n".join(lines)


def _model_id(store: Store, fingerprint: str) -> str | None:
    """The model id the store's record gives for a fingerprint (None: no valid record)."""
    from chunkstore.backends._models import read_model

    spec = read_model(store, bytes.fromhex(fingerprint))
    return None if spec is None else spec.model_id


def _read_header(
    store: Any,
    info: ChunkInfo,
    namespaces: dict[str, Tally],
    models: dict[str, Tally],
    corrupt: list[Problem],
    unsupported: list[Problem],
) -> None:
    from chunkstore.backends.base import ReadVerdict, verdict_of
    from chunkstore.cli.storeaccess import read_header_of

    try:
        header = read_header_of(store, info.key)
    except FormatError as exc:
        newer = verdict_of(exc) is ReadVerdict.UNSUPPORTED  # written by a newer chunkstore
        (unsupported if newer else corrupt).append(Problem(info, f"{type(exc).__name__}: {exc}"))
        return
    if header is None:  # removed since listing
        return
    if header.key != info.key.digest or header.namespace != info.key.namespace:
        corrupt.append(Problem(info, "KeyMismatch: header key or namespace differs from its name"))
        return
    fingerprint = header.fingerprint.hex()
    namespaces[info.key.namespace].models.add(fingerprint)
    model = models[fingerprint]
    model.add(info.size)
    model.models.add(info.key.namespace)
    model.tokens[len(header.tokens)] += 1
    model.versions[header.version] += 1
