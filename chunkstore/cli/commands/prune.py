"""``chunkstore prune URL``: remove chunks by total size (LRU), idle age or namespace."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chunkstore.cli.orphans import describe, sweep
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
from chunkstore.units import format_age, format_size, parse_age, parse_size

if TYPE_CHECKING:
    from chunkstore.backends.base import ChunkInfo

_SHOWN = 20

EPILOG = """examples:
  chunkstore prune /mnt/kvcache --max-bytes 500G          (drop least recently used first)
  chunkstore prune /mnt/kvcache --older-than 7d --dry-run (not read for a week)
  chunkstore prune /mnt/kvcache --namespace 3f2a9c0d11e4b6a7   (a whole namespace)
  chunkstore prune /mnt/kvcache --namespace 3f2a9c0d11e4b6a7 --max-bytes 50G

  chunkstore prune /mnt/kvcache -o index=redis://10.0.0.5:6379/0 --max-bytes 500G
  chunkstore prune /mnt/kvcache -o index=redis://10.0.0.5:6379/0 --reconcile --shard 0/4

Criteria combine: --namespace limits what is considered; --older-than removes
chunks whose last use (read or write) is older than AGE; --max-bytes then
removes least recently used chunks until the rest fits. --namespace alone
removes the whole namespace. Orphan temp files of killed writers older than
--grace are removed too. Sizes: 500G, 1.5T, 800MB; ages: 30m, 12h, 7d, 2w.

With a capacity index (-o index=URL: Redis or Valkey), --max-bytes and
--older-than evict through the index and walk nothing: the pass costs what it
removes. --reconcile walks the store (or one shard of it, --shard i/n, so that
several machines share the walk) and repairs the index from the files; it also
sweeps the orphans of what it walked (shard 0 also quarantine and staging).
"""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``prune`` subcommand."""
    parser = subparsers.add_parser(
        "prune",
        help="remove chunks: least recently used over a size, idle for an age, or a namespace",
        description="Remove chunks to bring a store under a size, drop stale or whole namespaces.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", metavar="URL", help="store: a directory, file://, s3://, fsspec URL")
    parser.add_argument(
        "--max-bytes", metavar="SIZE", help="remove least recently used chunks until under SIZE"
    )
    parser.add_argument(
        "--older-than", metavar="AGE", help="remove chunks not used for AGE (e.g. 7d)"
    )
    parser.add_argument(
        "--namespace",
        metavar="NS",
        type=namespace_arg,
        help="only this namespace; alone, remove all of it",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be removed, remove nothing"
    )
    parser.add_argument(
        "--reconcile",
        action="store_true",
        help="with a capacity index: walk the files and repair the index from them",
    )
    parser.add_argument(
        "--shard",
        metavar="I/N",
        type=shard_arg,
        help="with --reconcile: walk and sweep only shard I of N (fan-out directories I mod N)",
    )
    add_maintenance_options(parser, batch_default=256, batch_unit="deleted")
    add_output_options(parser)
    add_store_options(parser)
    parser.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Plan:
    """Which chunks go, and why."""

    victims: list[tuple[ChunkInfo, str]]
    """(chunk, reason) in removal order: ``namespace``, ``older-than`` or ``max-bytes``."""
    considered: int
    """Chunks in scope."""
    bytes_before: int
    """Bytes in scope before pruning."""

    @property
    def bytes_removed(self) -> int:
        """Bytes the victims hold."""
        return sum(info.size for info, _ in self.victims)


def plan_prune(
    infos: list[ChunkInfo],
    *,
    now: float,
    max_bytes: int | None,
    older_than: float | None,
    whole_namespace: bool,
) -> Plan:
    """Decide what to remove. Pure function of the listing, so dry runs show the real plan."""
    # Least recently used first; ties by write time, then key, for a deterministic order.
    ordered = sorted(infos, key=lambda i: (i.atime or i.mtime, i.mtime, i.key.namespace, i.key.hex))
    before = sum(i.size for i in ordered)
    victims: list[tuple[ChunkInfo, str]] = []
    if whole_namespace:
        victims = [(i, "namespace") for i in ordered]
        return Plan(victims, len(ordered), before)
    kept: list[ChunkInfo] = []
    for info in ordered:
        if older_than is not None and now - (info.atime or info.mtime) >= older_than:
            victims.append((info, "older-than"))
        else:
            kept.append(info)
    if max_bytes is not None:
        remaining = sum(i.size for i in kept)
        for info in kept:
            if remaining <= max_bytes:
                break
            victims.append((info, "max-bytes"))
            remaining -= info.size
    return Plan(victims, len(ordered), before)


def _victim_json(info: ChunkInfo, reason: str) -> dict[str, Any]:
    return {
        "key": info.key.hex,
        "namespace": info.key.namespace,
        "size": info.size,
        "atime": info.atime,
        "reason": reason,
    }


def shard_arg(text: str) -> tuple[int, int]:
    """argparse ``type=`` for ``--shard I/N``: one-line errors."""
    from chunkstore.backends._index import parse_shard

    try:
        return parse_shard(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Plan, then (unless --dry-run) delete in batches; through the index when there is one."""
    if args.shard is not None and not args.reconcile:
        raise ConfigError("--shard applies to --reconcile")
    if args.reconcile:
        return _run_indexed(args)
    if args.max_bytes is None and args.older_than is None and args.namespace is None:
        raise ConfigError(
            "prune needs at least one of --max-bytes, --older-than, --namespace, --reconcile"
        )
    if args.batch <= 0:
        raise ConfigError(f"--batch must be positive, got {args.batch}")
    max_bytes = parse_size(args.max_bytes) if args.max_bytes is not None else None
    older_than = parse_age(args.older_than) if args.older_than is not None else None
    grace = parse_age(args.grace)
    started = time.monotonic()
    removed = 0
    with open_cli_store(args.url, args) as store:
        if (
            getattr(store, "index", None) is not None
            and args.namespace is None
            and not args.dry_run
        ):
            return _run_indexed(args, store)
        now = time.time()
        infos = list(store.list(args.namespace))
        plan = plan_prune(
            infos,
            now=now,
            max_bytes=max_bytes,
            older_than=older_than,
            whole_namespace=max_bytes is None and older_than is None,
        )
        if not args.dry_run:
            with Progress("prune", len(plan.victims), quiet=args.quiet) as progress:
                for start in range(0, len(plan.victims), args.batch):
                    batch = [info.key for info, _ in plan.victims[start : start + args.batch]]
                    removed += store.delete_many(batch)
                    progress.advance(len(batch))
        strays = sweep(store, grace=grace, dry_run=args.dry_run)
    elapsed = time.monotonic() - started
    after = plan.bytes_before - plan.bytes_removed
    if args.json:
        emit_json(
            {
                "url": args.url,
                "dry_run": args.dry_run,
                "considered": plan.considered,
                "bytes_before": plan.bytes_before,
                "bytes_after": after,
                "planned": len(plan.victims),
                "removed": removed,
                "bytes_removed": plan.bytes_removed,
                "chunks": [_victim_json(i, r) for i, r in plan.victims],
                **strays.as_json(),
                "seconds": round(elapsed, 3),
            }
        )
        return 0
    lines = []
    if args.dry_run and plan.victims:
        rows = [
            [
                i.key.namespace,
                i.key.hex[:16],
                format_size(i.size),
                format_age(now - (i.atime or i.mtime)),
                reason,
            ]
            for i, reason in plan.victims[:_SHOWN]
        ]
        lines.append(
            render_table(["namespace", "key", "size", "used", "reason"], rows, right=[2, 3])
        )
        if len(plan.victims) > _SHOWN:
            lines.append(f"... and {len(plan.victims) - _SHOWN} more (--json lists all)")
        lines.append("")
    verb = "would remove" if args.dry_run else "removed"
    count = len(plan.victims) if args.dry_run else removed
    lines.append(
        f"{verb} {count} of {plan.considered} chunks, {format_size(plan.bytes_removed)}: "
        f"{format_size(plan.bytes_before)} -> {format_size(after)}"
    )
    if not args.dry_run and removed < len(plan.victims):
        lines.append(f"{len(plan.victims) - removed} chunk(s) were already gone")
    lines.extend(describe(strays, dry_run=args.dry_run))
    emit_text("\n".join(lines))
    return 0


def _run_indexed(args: argparse.Namespace, store: Any = None) -> int:
    """Evict through the store's capacity index, and reconcile it (``--reconcile``)."""
    if store is None:
        with open_cli_store(args.url, args) as opened:
            return _run_indexed(args, opened)
    index = getattr(store, "index", None)
    if index is None:
        raise ConfigError("--reconcile needs a capacity index: -o index=redis://HOST:6379/0")
    if args.namespace is not None or args.dry_run:
        raise ConfigError("--reconcile takes neither --namespace nor --dry-run")
    started = time.monotonic()
    report: dict[str, Any] = {"url": args.url, "index": index.store_id}
    lines = []
    if args.reconcile:
        with Progress("reconcile", None, quiet=args.quiet) as progress:
            done = index.reconcile(shard=args.shard, progress=progress.advance)
        report["reconciled"] = {"walked": done.walked, "added": done.added, "removed": done.removed}
        where = "" if args.shard is None else f" (shard {args.shard[0]}/{args.shard[1]})"
        lines.append(
            f"reconciled{where}: walked {done.walked} chunks, added {done.added} the index "
            f"lacked, removed {done.removed} whose files were gone"
        )
    max_bytes = parse_size(args.max_bytes) if args.max_bytes is not None else None
    older_than = parse_age(args.older_than) if args.older_than is not None else None
    if max_bytes is not None or older_than is not None:
        evicted = index.evict(max_bytes=max_bytes, older_than=older_than)
        report["removed"] = evicted
        lines.append(f"evicted {evicted} chunks through the index")
    if args.reconcile:
        strays = sweep(store, grace=parse_age(args.grace), dry_run=False, shard=args.shard)
        report.update(strays.as_json())
        lines.extend(describe(strays, dry_run=False))
    usage = index.usage()
    report.update(bytes_after=usage.bytes, chunks_after=usage.chunks)
    report["seconds"] = round(time.monotonic() - started, 3)
    if args.json:
        emit_json(report)
        return 0
    lines.append(f"the index counts {usage.chunks} chunks, {format_size(usage.bytes)}")
    emit_text("\n".join(lines))
    return 0
