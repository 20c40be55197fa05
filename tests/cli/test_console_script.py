"""The installed ``chunkstore`` console script, run as a real process."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

from tests.cli.conftest import DamagedStore, GoodStore

SCRIPT = Path(sys.executable).parent / "chunkstore"


def _run(*args: object, **kwargs) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.exists(), f"console script not installed at {SCRIPT}"
    return subprocess.run(
        [str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120, **kwargs
    )


def test_verify_through_the_console_script(damaged: DamagedStore) -> None:
    proc = _run("verify", damaged.root, "--json")
    assert proc.returncode == 1
    assert proc.stderr == ""  # no progress bar and no warnings when stderr is not a terminal
    doc = json.loads(proc.stdout)
    assert len(doc["corrupt"]) == 6 and doc["ok"] == 8
    assert _run("verify", damaged.root).returncode == 0  # the corrupt ones are quarantined


def test_error_is_one_line_with_exit_code(tmp_path) -> None:
    proc = _run("inspect", tmp_path / "missing")
    assert proc.returncode == 4
    assert proc.stdout == ""
    assert (
        proc.stderr
        == f"chunkstore inspect: error: no such store directory: {tmp_path / 'missing'}\n"
    )


def _stderr_on_a_tty(*args: object) -> str:
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [str(SCRIPT), *map(str, args)],
            stdout=subprocess.DEVNULL,
            stderr=slave,
            timeout=120,
        )
        assert proc.returncode == 0
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode()
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def test_progress_bar_on_a_terminal_and_quiet(good: GoodStore) -> None:
    drawn = _stderr_on_a_tty("verify", good.root)
    assert "verify [" in drawn and "8/8" in drawn and "chunks/s" in drawn
    assert _stderr_on_a_tty("verify", good.root, "--quiet") == ""
