"""``chunkstore cp SRC DST``: copy (sync) chunks between any two stores, verifying each."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.cli import integrity
from chunkstore.cli.exitcodes import FAILURE, OK
from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.progress import Progress
from chunkstore.cli.storeargs import (
    add_output_options,
    add_store_options,
    local_path,
    namespace_arg,
    open_cli_store,
)
from chunkstore.cli.table import render_table
from chunkstore.errors import ConfigError
from chunkstore.units import format_size

if TYPE_CHECKING:
    from chunkstore.backends.base import ChunkInfo, Store

EPILOG = """examples:
  chunkstore cp /mnt/kvcache s3://new-cluster-bucket/kv    (seed a bucket from a shared mount)
  chunkstore cp s3://bucket/kv /local/nvme/kv --namespace 3f2a9c0d11e4b6a7
  chunkstore cp /mnt/a /mnt/b --json

Every chunk is decoded with checksum and key checks before it is written; a
corrupt source chunk is reported and not copied (the source is never changed).
Chunks the destination already has are skipped (put-if-absent), so running it
again resumes or syncs new chunks. Exit status 1 when corrupt chunks were found.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``cp`` subcommand."""
    parser = subparsers.add_parser(
        "cp",
        help="copy or sync chunks between two stores, verifying each",
        description=(
            "Copy every chunk of SRC that DST lacks, verifying each on the way. "
            "Works between any two stores (directories, fsspec URLs, s3://)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help="source store URL")
    parser.add_argument("dst", metavar="DST", help="destination store URL (created if missing)")
    parser.add_argument("--namespace", metavar="NS", type=namespace_arg, help="only this namespace")
    parser.add_argument(
        "--batch", type=int, default=64, metavar="N", help="chunks per request (default 64)"
    )
    add_output_options(parser)
    add_store_options(parser, "src")
    add_store_options(parser, "dst")
    parser.set_defaults(func=run)


@dataclass(slots=True)
class CopyReport:
    """Counts of one copy."""

    listed: int = 0
    """Chunks in the source (in scope)."""
    copied: int = 0
    """Chunks written to the destination."""
    copied_bytes: int = 0
    """Bytes written."""
    skipped: int = 0
    """Chunks the destination already had."""
    vanished: int = 0
    """Chunks listed in the source but gone when read."""
    refused: int = 0
    """Chunks DST declined to store and does not hold (one bigger than its ``max_bytes``)."""
    unreadable: list[ChunkInfo] = field(default_factory=list)
    """Source chunks still there that could not be read (EIO, ESTALE, EACCES): not copied."""
    bad: list[tuple[ChunkInfo, integrity.Verdict]] = field(default_factory=list)
    """Source chunks that failed verification (or have an unsupported version): not copied."""

    def as_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "listed": self.listed,
            "copied": self.copied,
            "copied_bytes": self.copied_bytes,
            "skipped_existing": self.skipped,
            "vanished": self.vanished,
            "refused": self.refused,
            "unreadable": [
                {"key": i.key.hex, "namespace": i.key.namespace} for i in self.unreadable
            ],
            "not_copied": [
                {
                    "key": i.key.hex,
                    "namespace": i.key.namespace,
                    "status": v.status,
                    "problem": v.problem,
                }
                for i, v in self.bad
            ],
        }


def _same_store(src: str, dst: str) -> bool:
    a, b = local_path(src), local_path(dst)
    if a is not None and b is not None:
        return a.resolve() == b.resolve()
    return src.rstrip("/") == dst.rstrip("/")


def _copy_model_records(src: Store, dst: Store, fingerprints: set[bytes]) -> None:
    """The source's model records of the copied chunks' models, so that ``inspect`` names them
    in DST too (best effort, like every record write)."""
    from chunkstore.backends._models import read_model, record_model

    for fingerprint in sorted(fingerprints):
        spec = read_model(src, fingerprint)
        if spec is not None:
            record_model(dst, spec)


def run(args: argparse.Namespace) -> int:
    """Copy in batches: ask DST which keys it lacks, read and verify those, put_if_absent."""
    from chunkstore.cli.storeaccess import (
        read_error_count,
        read_raw_many,
        stop_access_tracking,
        unreadable_among,
    )
    from chunkstore.format import read_header

    if args.batch <= 0:
        raise ConfigError(f"--batch must be positive, got {args.batch}")
    if _same_store(args.src, args.dst):
        raise ConfigError("SRC and DST are the same store")
    report = CopyReport()
    started = time.monotonic()
    with (
        open_cli_store(args.src, args, prefix="src") as src,
        open_cli_store(args.dst, args, prefix="dst", create=True) as dst,
    ):
        stop_access_tracking(src)
        infos = sorted(src.list(args.namespace), key=lambda i: (i.key.namespace, i.key.hex))
        report.listed = len(infos)
        fingerprints: set[bytes] = set()
        with Progress("cp", len(infos), quiet=args.quiet) as progress:
            for start in range(0, len(infos), args.batch):
                batch = infos[start : start + args.batch]
                present = dst.exists_many([i.key for i in batch])
                wanted = [i for i, here in zip(batch, present) if not here]
                report.skipped += len(batch) - len(wanted)
                keys = [i.key for i in wanted]
                errors_before = read_error_count(src)
                raws = read_raw_many(src, keys) if wanted else []
                unread = unreadable_among(src, keys, raws, errors_before)
                items = []
                for n, (info, raw) in enumerate(zip(wanted, raws)):
                    if n in unread:  # still in SRC, but the read failed (EIO, ESTALE, EACCES)
                        report.unreadable.append(info)
                        continue
                    if raw is None:
                        report.vanished += 1
                        continue
                    verdict = integrity.judge(raw, info.key)
                    if verdict.status != integrity.OK:
                        report.bad.append((info, verdict))
                        continue
                    items.append((info.key, raw))
                    fingerprints.add(read_header(raw).fingerprint)
                if items:
                    written = dst.put_if_absent_many(items)
                    declined = [key for (key, _), wrote in zip(items, written) if not wrote]
                    # False is "already there" or a refusal (a chunk bigger than DST's cap)
                    there = dict(zip(declined, dst.exists_many(declined))) if declined else {}
                    for (key, raw), wrote in zip(items, written):
                        if wrote:
                            report.copied += 1
                            report.copied_bytes += len(raw)
                        elif there[key]:  # another writer got there between exists and put
                            report.skipped += 1
                        else:
                            report.refused += 1
                progress.advance(len(batch))
        _copy_model_records(src, dst, fingerprints)
    elapsed = time.monotonic() - started
    failed = any(v.status == integrity.CORRUPT for _, v in report.bad) or bool(
        report.unreadable or report.refused
    )
    if args.json:
        emit_json(
            {"src": args.src, "dst": args.dst, **report.as_json(), "seconds": round(elapsed, 3)}
        )
        return FAILURE if failed else OK
    lines = []
    if report.bad:
        rows = [
            [i.key.namespace, i.key.hex[:16], v.status, v.problem.split(":", 1)[0]]
            for i, v in report.bad
        ]
        lines.append(render_table(["namespace", "key", "status", "problem"], rows))
        lines.append("")
    rate = f" ({format_size(report.copied_bytes / elapsed)}/s)" if elapsed > 0 else ""
    lines.append(
        f"copied {report.copied} chunks ({format_size(report.copied_bytes)}) in "
        f"{elapsed:.1f}s{rate}; {report.skipped} already present; "
        f"{len(report.bad)} not copied (failed verification or unsupported)"
        + (f"; {report.vanished} vanished" if report.vanished else "")
        + (f"; {report.refused} not stored (refused by DST)" if report.refused else "")
        + (f"; {len(report.unreadable)} unreadable (read error)" if report.unreadable else "")
    )
    lines.extend(
        f"cannot read {i.key.namespace}/{i.key.hex} in SRC (I/O or permission error; see the log)"
        for i in report.unreadable
    )
    emit_text("\n".join(lines))
    return FAILURE if failed else OK
