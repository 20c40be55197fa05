"""Sweeping a store's stray files: orphan temp files go once older than a grace period.

A writer killed mid-write leaves its unique temp file behind; a live writer's
temp file looks the same, so only files older than the grace period (default
one hour, far longer than any single chunk write) are removed. Foreign files
may be someone's data and are only reported; quarantined chunks are counted.

A capped writer that deletes a victim the capacity index had no access record noted for
leaves that record behind (spec 6.8); past the grace period (by its last use, its mtime)
the sweep deletes such a record, unless its chunk was stored again meanwhile.

A set-aside killed between its two renames leaves its staged file in
``quarantine/<ns>/`` or ``.chunkstore/``; past the grace period (by the time it
was staged, its ctime) the sweep finishes it: a corrupt chunk gets its quarantine
name, a delete is done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chunkstore.backends.base import Store
    from chunkstore.cli.storeaccess import Stray

DEFAULT_GRACE = "1h"
_INTO_QUARANTINE = "staged-quarantine"


@dataclass(frozen=True, slots=True)
class StraySweep:
    """What a sweep found and did."""

    removed: list[Stray] = field(default_factory=list)
    """Orphan temp files removed (or that would be, in a dry run)."""
    young: list[Stray] = field(default_factory=list)
    """Temp files within the grace period (possibly a write in progress): kept."""
    foreign: list[Stray] = field(default_factory=list)
    """Files that are not chunkstore's: reported, never touched."""
    quarantined: list[Stray] = field(default_factory=list)
    """Chunks previously moved to quarantine."""
    stranded: list[Stray] = field(default_factory=list)
    """Staged files of killed set-asides past the grace period: moved to their quarantine
    name or deleted (or that would be, in a dry run)."""
    staged_young: list[Stray] = field(default_factory=list)
    """Staged files within the grace period (possibly a set-aside in progress): kept."""
    lone_records: list[Stray] = field(default_factory=list)
    """Access records beside no chunk, last used before the grace period: removed (or that
    would be, in a dry run)."""

    def as_json(self) -> dict[str, Any]:
        """JSON-friendly summary with the paths."""
        return {
            "orphans_removed": [s.path for s in self.removed],
            "orphan_bytes": sum(s.size for s in self.removed),
            "temp_in_grace": [s.path for s in self.young],
            "foreign": [s.path for s in self.foreign],
            "quarantined": len(self.quarantined),
            "stranded_quarantined": [s.path for s in self.stranded if s.kind == _INTO_QUARANTINE],
            "stranded_removed": [s.path for s in self.stranded if s.kind != _INTO_QUARANTINE],
            "staged_in_grace": [s.path for s in self.staged_young],
            "lone_records_removed": [s.path for s in self.lone_records],
        }


def sweep(
    store: Store, *, grace: float, dry_run: bool, shard: tuple[int, int] | None = None
) -> StraySweep:
    """Classify the store's strays; remove orphan temp files and finish stranded set-asides
    older than ``grace`` seconds.

    With ``shard=(i, n)``, only the temp and foreign files of that shard's fan-out
    directories; shard 0 also takes the quarantine and the stranded set-asides, which sit
    outside them. The ``n`` shards' sweeps together are the whole sweep, each file in one.
    """
    from chunkstore.cli.storeaccess import (
        find_strays,
        quarantined,
        remove_lone_records,
        remove_unfinished,
        settle_stranded,
        stranded_files,
    )

    # One walk, temp and foreign files together (split by age here). It lists each
    # directory and stats only what is not a chunk: a chunk walk stats every file.
    cutoff = time.time() - grace
    found = find_strays(store, shard)
    old = [(f, s) for f, s in found.temps if s.mtime <= cutoff]
    young = [s for _, s in found.temps if s.mtime > cutoff]
    lone = [(f, s) for f, s in found.lone_records if s.mtime <= cutoff]
    areas = shard is None or shard[0] == 0  # quarantine and staging: one shard's to sweep
    staged = stranded_files(store) if areas else []
    if not areas:
        stranded = []
    elif not dry_run:
        stranded = settle_stranded(store, grace)
    else:
        stranded = [s for s in staged if s.mtime <= cutoff]
    settled = {s.path for s in stranded}
    result = StraySweep(
        removed=sorted((s for _, s in old), key=lambda s: s.path),
        young=sorted(young, key=lambda s: s.path),
        foreign=sorted(found.foreign, key=lambda s: s.path),
        quarantined=sorted(quarantined(store), key=lambda s: s.path) if areas else [],
        stranded=sorted(stranded, key=lambda s: s.path),
        staged_young=sorted(
            (s for s in staged if s.mtime > cutoff and s.path not in settled), key=lambda s: s.path
        ),
    )
    if not dry_run:
        remove_unfinished(store, [f for f, _ in old])
        went = remove_lone_records(store, [f for f, _ in lone])
        lone = [(f, s) for f, s in lone if f.path in went]  # (one stored again is kept)
    result.lone_records.extend(sorted((s for _, s in lone), key=lambda s: s.path))
    return result


def describe(result: StraySweep, *, dry_run: bool) -> list[str]:
    """Human summary lines (empty when there were no strays)."""
    lines = []
    if result.removed:
        verb = "would remove" if dry_run else "removed"
        lines.append(f"{verb} {len(result.removed)} orphan temp file(s)")
    if result.young:
        lines.append(f"kept {len(result.young)} temp file(s) younger than the grace period")
    if result.foreign:
        shown = ", ".join(s.path for s in result.foreign[:5])
        more = f" and {len(result.foreign) - 5} more" if len(result.foreign) > 5 else ""
        lines.append(f"left {len(result.foreign)} foreign file(s) alone: {shown}{more}")
    into = [s for s in result.stranded if s.kind == _INTO_QUARANTINE]
    if into:
        verb = "would finish" if dry_run else "finished"
        lines.append(f"{verb} moving {len(into)} stranded staged chunk(s) into quarantine")
    if len(into) < len(result.stranded):
        verb = "would remove" if dry_run else "removed"
        count = len(result.stranded) - len(into)
        lines.append(f"{verb} {count} stranded staged delete(s) from .chunkstore")
    if result.staged_young:
        count = len(result.staged_young)
        lines.append(f"kept {count} staged set-aside file(s) younger than the grace period")
    if result.lone_records:
        verb = "would remove" if dry_run else "removed"
        count = len(result.lone_records)
        lines.append(f"{verb} {count} access record(s) whose chunk is gone")
    if result.quarantined:
        lines.append(f"{len(result.quarantined)} chunk(s) in quarantine")
    return lines
