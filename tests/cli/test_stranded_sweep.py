"""``prune`` and ``verify`` finish what a killed set-aside left staged in ``quarantine/<ns>/``
and ``.chunkstore/``, and say so (text and ``--json``); a dry run only lists them, and
staged files within the grace period are kept. (Age is the ctime, which os.utime cannot
set back: "old" here is ``--grace 0s``.)"""

from __future__ import annotations

import os
from pathlib import Path

from chunkstore.backends import _layout as L
from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks
from chunkstore.testing.store_suite import corrupt_copies

CHUNKS = sample_chunks(2, seed=29)


def _stranded_store(tmp_path: Path) -> tuple[Path, str, str]:
    """A store with one good chunk, one damaged chunk stranded on its way to quarantine and
    one stranded delete: (root, the quarantine leftover, the delete leftover), relative."""
    root = tmp_path / "s"
    bad = corrupt_copies(CHUNKS[1])["bitflip"]
    with FsStore(str(root), create=True) as store:
        store.put(CHUNKS[0].key, CHUNKS[0].data)
        store.put(CHUNKS[1].key, bad)
        ns = CHUNKS[1].key.namespace
        qdir = root / L.QUARANTINE_DIR / ns
        qdir.mkdir(parents=True)
        staged = qdir / L.temp_name(CHUNKS[1].key.hex)
        os.rename(store.path_of(CHUNKS[1].key), staged)
    state = root / L.STATE_DIR
    state.mkdir(exist_ok=True)
    deleting = state / L.temp_name(CHUNKS[1].key.hex)
    deleting.write_bytes(bad)
    return root, str(staged.relative_to(root)), str(deleting.relative_to(root))


def test_prune_finishes_stranded_set_asides(cli, tmp_path: Path) -> None:
    root, staged, deleting = _stranded_store(tmp_path)
    doc = cli("prune", root, "--max-bytes", "1T", "--grace", "0s", "--json").json()
    assert doc["stranded_quarantined"] == [staged]
    assert doc["stranded_removed"] == [deleting]
    assert doc["staged_in_grace"] == []
    assert doc["quarantined"] == 1
    hex_digest = CHUNKS[1].key.hex
    assert (root / L.QUARANTINE_DIR / CHUNKS[1].key.namespace / f"{hex_digest}.kvc").exists()
    assert not (root / staged).exists() and not (root / deleting).exists()


def test_verify_text_output_names_them(cli, tmp_path: Path) -> None:
    root, staged, deleting = _stranded_store(tmp_path)
    result = cli("verify", root, "--grace", "0s")
    assert result.rc == 0, result.err
    assert "finished moving 1 stranded staged chunk(s) into quarantine" in result.out
    assert "removed 1 stranded staged delete(s) from .chunkstore" in result.out
    assert not (root / staged).exists()


def test_dry_run_lists_and_keeps_them(cli, tmp_path: Path) -> None:
    root, staged, deleting = _stranded_store(tmp_path)
    result = cli("verify", root, "--dry-run", "--grace", "0s")
    assert "would finish moving 1 stranded staged chunk(s) into quarantine" in result.out
    assert "would remove 1 stranded staged delete(s) from .chunkstore" in result.out
    doc = cli("prune", root, "--max-bytes", "1T", "--dry-run", "--grace", "0s", "--json").json()
    assert (doc["stranded_quarantined"], doc["stranded_removed"]) == ([staged], [deleting])
    assert (root / staged).exists() and (root / deleting).exists()


def test_young_ones_are_kept_and_shown(cli, tmp_path: Path) -> None:
    root, staged, deleting = _stranded_store(tmp_path)
    result = cli("verify", root)
    assert "kept 2 staged set-aside file(s) younger than the grace period" in result.out
    doc = cli("verify", root, "--json").json()
    assert doc["staged_in_grace"] == sorted([staged, deleting])
    assert doc["stranded_quarantined"] == doc["stranded_removed"] == []
    assert (root / staged).exists() and (root / deleting).exists()
