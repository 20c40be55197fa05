"""``chunkstore verify URL``: decode every chunk with its checksum; set aside or delete bad ones."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkstore.cli import integrity
from chunkstore.cli.commands.prune import shard_arg
from chunkstore.cli.exitcodes import FAILURE, OK
from chunkstore.cli.orphans import StraySweep, describe, sweep
from chunkstore.cli.output import emit_json, emit_text
from chunkstore.cli.progress import Progress
from chunkstore.cli.storeargs import (
    add_maintenance_options,
    add_output_options,
    add_store_options,
    namespace_arg,
    open_cli_store,
)
from chunkstore.cli.table import render_table
from chunkstore.errors import ConfigError
from chunkstore.units import format_size, parse_age

if TYPE_CHECKING:
    from chunkstore.backends.base import ChunkInfo, Store
    from chunkstore.hashing import ChunkKey

EPILOG = """examples:
  chunkstore verify /mnt/kvcache                 (corrupt chunks go to <root>/quarantine/)
  chunkstore verify /mnt/kvcache --delete
  chunkstore verify s3://bucket/kv --dry-run --json

Exit status 1 when corrupt chunks were found (whatever was done with them).
Chunks of a format version this chunkstore cannot read (a newer writer) are
reported as "unsupported" and left alone. Only the very chunk that was judged
is set aside (a file by inode or content, an S3 object by ETag): one a writer
replaced (or removed) while verify was checking it is "left (changed while
checking)". Orphan temp files
of killed writers older than --grace are removed; foreign files are reported,
never touched.
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``verify`` subcommand."""
    parser = subparsers.add_parser(
        "verify",
        help="check every chunk's checksum and key; quarantine or delete corrupt ones",
        description=(
            "Read and decode every chunk with checksum verification and key checks. "
            "Corrupt chunks are quarantined (default), deleted (--delete) or only "
            "reported (--dry-run)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", metavar="URL", help="store: a directory, file://, s3://, fsspec URL")
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--quarantine",
        dest="action",
        action="store_const",
        const="quarantine",
        help="move corrupt chunks to the store's quarantine area (default)",
    )
    action.add_argument(
        "--delete",
        dest="action",
        action="store_const",
        const="delete",
        help="delete corrupt chunks",
    )
    action.add_argument(
        "--dry-run",
        dest="action",
        action="store_const",
        const="report",
        help="change nothing, only report",
    )
    parser.set_defaults(action="quarantine")
    parser.add_argument("--namespace", metavar="NS", type=namespace_arg, help="only this namespace")
    parser.add_argument(
        "--shard",
        metavar="I/N",
        type=shard_arg,
        help="only shard I of N (fan-out directories I mod N): N machines share one store's "
        "pass, the orphan sweep included (shard 0 also sweeps quarantine and staging)",
    )
    add_maintenance_options(parser, batch_default=64, batch_unit="read")
    add_output_options(parser)
    add_store_options(parser)
    parser.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Finding:
    """A chunk that did not verify."""

    info: ChunkInfo
    """The chunk as listed."""
    verdict: integrity.Verdict
    """What the decoder said."""
    action: str
    """What was done: quarantined, deleted, left (dry run / unsupported)."""

    def as_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "key": self.info.key.hex,
            "namespace": self.info.key.namespace,
            "size": self.info.size,
            "status": self.verdict.status,
            "problem": self.verdict.problem,
            "action": self.action,
        }


@dataclass(slots=True)
class Tally:
    """What a verify run found, filled batch by batch."""

    findings: list[Finding] = field(default_factory=list)
    """Chunks that did not verify, with what was done about them."""
    checked: int = 0
    """Chunks read and judged."""
    good: int = 0
    """Chunks that verified."""
    good_bytes: int = 0
    """Bytes of those."""
    vanished: int = 0
    """Chunks listed but gone when read (a concurrent prune or eviction)."""
    unreadable: list[ChunkInfo] = field(default_factory=list)
    """Chunks still there that the store could not read (EIO, ESTALE, EACCES): not judged."""

    def with_status(self, status: str) -> list[Finding]:
        """The findings with verdict ``status``."""
        return [f for f in self.findings if f.verdict.status == status]


@dataclass(frozen=True, slots=True)
class Judged:
    """One chunk judged bad, and which file was read (for a checked removal)."""

    info: ChunkInfo
    """The chunk as listed."""
    verdict: integrity.Verdict
    """Not ok."""
    ident: Any
    """The file read, where the store can tell (``None`` otherwise)."""


def run(args: argparse.Namespace) -> int:
    """Verify every chunk, act on corrupt ones, sweep orphans, report."""
    from chunkstore.cli.storeaccess import stop_access_tracking

    grace = parse_age(args.grace)
    if args.batch <= 0:
        raise ConfigError(f"--batch must be positive, got {args.batch}")
    started = time.monotonic()
    tally = Tally()
    with open_cli_store(args.url, args) as store:
        stop_access_tracking(store)
        if args.shard is not None and args.namespace is not None:
            raise ConfigError("--shard and --namespace do not combine")
        if args.shard is None:
            listed: Any = store.list(args.namespace)
        else:
            from chunkstore.backends._index import chunks_of_shard

            listed = chunks_of_shard(store, args.shard)
        infos = sorted(listed, key=lambda i: (i.key.namespace, i.key.hex))
        with Progress("verify", len(infos), quiet=args.quiet) as progress:
            for start in range(0, len(infos), args.batch):
                batch = infos[start : start + args.batch]
                bad = _judge_batch(store, batch, tally)
                tally.findings.extend(_act(store, bad, args.action))
                progress.advance(len(batch))
        # A sharded pass sweeps its own directories: the shards together sweep them all.
        strays = sweep(store, grace=grace, dry_run=args.action == "report", shard=args.shard)
    elapsed = time.monotonic() - started
    if args.json:
        emit_json(_document(args, tally, strays, elapsed))
    else:
        emit_text(_render(tally, strays, elapsed, dry_run=args.action == "report"))
    return FAILURE if tally.with_status(integrity.CORRUPT) or tally.unreadable else OK


# --- collect: read a batch and judge it ----------------------------------------------------


def _read_batch(store: Store, keys: list[ChunkKey]) -> tuple[list[Any], list[Any]]:
    """Raw bytes per key (None if gone) and, where the store can tell, an ident of each file
    read (so only that very file is set aside if it is bad)."""
    from chunkstore.backends.maintenance import SupportsCheckedRemoval
    from chunkstore.cli.storeaccess import read_raw_many

    if not isinstance(store, SupportsCheckedRemoval):
        return read_raw_many(store, keys), [None] * len(keys)
    pairs = store.read_unchecked_with_idents(keys)
    return (
        [None if p is None else p[0] for p in pairs],
        [None if p is None else p[1] for p in pairs],
    )


def _judge_batch(store: Store, batch: list[ChunkInfo], tally: Tally) -> list[Judged]:
    """Read and judge ``batch``; counts go to ``tally``, the chunks that failed come back."""
    from chunkstore.cli.storeaccess import read_error_count, unreadable_among

    keys = [i.key for i in batch]
    errors_before = read_error_count(store)
    raws, idents = _read_batch(store, keys)
    failed = unreadable_among(store, keys, raws, errors_before)
    bad = []
    for n, (info, raw, ident) in enumerate(zip(batch, raws, idents)):
        if n in failed:  # still there, but the read failed (EIO, ESTALE, EACCES)
            tally.unreadable.append(info)
            continue
        if raw is None:  # deleted since listing (a concurrent prune or eviction)
            tally.vanished += 1
            continue
        tally.checked += 1
        verdict = integrity.judge(raw, info.key)
        if verdict.status == integrity.OK:
            tally.good += 1
            tally.good_bytes += info.size
        else:
            bad.append(Judged(info, verdict, ident))
    return bad


# --- act: set aside, delete or leave what failed -------------------------------------------


def _act(store: Store, bad: list[Judged], action: str) -> list[Finding]:
    """Apply ``action`` (quarantine, delete or report) to the chunks judged bad."""
    from chunkstore.backends.maintenance import SupportsCheckedRemoval
    from chunkstore.cli.storeaccess import has_quarantine, quarantine

    done_label = {
        "quarantine": "quarantined" if has_quarantine(store) else "deleted (no quarantine)",
        "delete": "deleted",
        "report": "left (dry run)",
    }[action]
    findings = []
    to_delete = []
    for judged in bad:
        info, verdict = judged.info, judged.verdict
        if verdict.status == integrity.UNSUPPORTED:
            findings.append(Finding(info, verdict, "left (unsupported version)"))
            continue
        label = done_label
        if isinstance(store, SupportsCheckedRemoval) and action != "report":
            # only the very file judged here: a writer may have replaced it since
            if action == "quarantine":
                done = store.quarantine_if_unchanged(info.key, judged.ident, verdict.problem)
            else:
                done = store.delete_if_unchanged(info.key, judged.ident)
            label = done_label if done else "left (changed while checking)"
        elif action == "quarantine":
            quarantine(store, info.key, verdict.problem)
        elif action == "delete":
            to_delete.append(info.key)
        findings.append(Finding(info, verdict, label))
    if to_delete:
        store.delete_many(to_delete)
    return findings


# --- render --------------------------------------------------------------------------------


def _document(
    args: argparse.Namespace, tally: Tally, strays: StraySweep, elapsed: float
) -> dict[str, Any]:
    """The ``--json`` document."""
    return {
        "url": args.url,
        "checked": tally.checked,
        "ok": tally.good,
        "ok_bytes": tally.good_bytes,
        "corrupt": [f.as_json() for f in tally.with_status(integrity.CORRUPT)],
        "unsupported": [f.as_json() for f in tally.with_status(integrity.UNSUPPORTED)],
        "vanished": tally.vanished,
        "unreadable": [{"key": i.key.hex, "namespace": i.key.namespace} for i in tally.unreadable],
        "action": args.action,
        **strays.as_json(),
        "seconds": round(elapsed, 3),
        "chunks_per_s": round(tally.checked / elapsed, 1) if elapsed > 0 else None,
    }


def _render(tally: Tally, strays: StraySweep, elapsed: float, *, dry_run: bool) -> str:
    """The human report: a table of findings, a summary line, the stray files."""
    lines = []
    if tally.findings:
        rows = [
            [
                f.info.key.namespace,
                f.info.key.hex[:16],
                format_size(f.info.size),
                f.verdict.problem.split(":", 1)[0],
                f.action,
            ]
            for f in tally.findings
        ]
        lines.append(
            render_table(["namespace", "key", "size", "problem", "action"], rows, right=[2])
        )
        lines.append("")
    checked = tally.checked
    corrupt = len(tally.with_status(integrity.CORRUPT))
    unsupported = len(tally.with_status(integrity.UNSUPPORTED))
    rate = f", {checked / elapsed:,.0f} chunks/s" if elapsed > 0 and checked else ""
    lines.append(
        f"verified {checked} chunks in {elapsed:.1f}s{rate}: {tally.good} ok "
        f"({format_size(tally.good_bytes)}), {corrupt} corrupt, {unsupported} unsupported"
        + (f", {tally.vanished} vanished while checking" if tally.vanished else "")
        + (f", {len(tally.unreadable)} unreadable (read error)" if tally.unreadable else "")
    )
    lines.extend(
        f"cannot read {i.key.namespace}/{i.key.hex} (I/O or permission error; see the log)"
        for i in tally.unreadable
    )
    lines.extend(describe(strays, dry_run=dry_run))
    return "\n".join(lines)
