"""README.md stays true: its API example runs; every metric, command and option is in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from chunkstore.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def test_python_api_example_runs() -> None:
    block = re.search(r"```python\n(.*?)```", _section("Python API: keys and chunks"), re.S)
    assert block is not None
    exec(compile(block.group(1), "README.md", "exec"), {})


def test_every_metric_is_documented() -> None:
    names = set()
    for path in (ROOT / "chunkstore").rglob("*.py"):
        names |= set(re.findall(r"[\"'](chunkstore_[a-z_]+)[\"']", path.read_text()))
    assert len(names) >= 20
    missing = sorted(n for n in names if n not in README)
    assert not missing, f"metrics missing from README.md: {missing}"


def test_every_cli_command_is_documented() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert {
        "ls",
        "inspect",
        "show",
        "verify",
        "prune",
        "cp",
        "demo",
        "serve",
        "simulate",
        "peers",
    } <= set(commands)
    missing = sorted(c for c in commands if f"chunkstore {c}" not in README)
    assert not missing, f"commands missing from README.md: {missing}"


def test_every_connector_option_is_documented() -> None:
    config = pytest.importorskip("chunkstore.vllm.config")
    section = _section("vLLM")
    missing = sorted(o for o in config.OPTIONS if f"`{o}`" not in section)
    assert not missing, f"connector options missing from README.md: {missing}"
