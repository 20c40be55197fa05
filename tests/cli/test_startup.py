"""``chunkstore --help`` and ``chunkstore ls`` start without loading the heavy dependencies.

Each case runs the command in a fresh interpreter and reads back which modules it
loaded (``tools/bench_cli_startup.py`` measures the time it takes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.cli.conftest import GoodStore

HEAVY = (
    "fsspec",
    "ml_dtypes",
    "msgpack",
    "nixl",
    "numpy",
    "prometheus_client",
    "redis",
    "s3fs",
    "torch",
    "vllm",
    "zmq",
    "zstandard",
)
"""Third-party packages that neither command needs."""

STORE_SIDE = (
    "chunkstore.cache._host",
    "chunkstore.tiering._tiered",
    "chunkstore.demo",
    "chunkstore.metrics",
    "chunkstore.node",
    "chunkstore.peer",
    "chunkstore.vllm",
)
"""chunkstore's own modules of caches, services and engines, which neither command uses."""

_RUN_MAIN = """
import contextlib, io, json, sys
from chunkstore.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        rc = main(sys.argv[1:])
    except SystemExit as exc:
        rc = exc.code
print(json.dumps({"rc": rc, "out": out.getvalue(), "modules": sorted(sys.modules)}))
"""


def _run(*args: object) -> tuple[str, set[str]]:
    """Run ``chunkstore ARGS`` in a fresh interpreter: its output and the modules it loaded."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_MAIN, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        check=True,
    )
    result = json.loads(proc.stdout)
    assert result["rc"] == 0, proc.stderr
    return result["out"], set(result["modules"])


def _loaded(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(m == n or m.startswith(f"{n}.") for m in modules))


@pytest.mark.parametrize("args", [["--help"], ["ls", "--help"]], ids=" ".join)
def test_help_loads_no_heavy_module_and_no_store_code(args: list[str]) -> None:
    out, modules = _run(*args)
    assert "usage: chunkstore" in out
    assert _loaded(modules, HEAVY) == []
    assert _loaded(modules, STORE_SIDE) == []
    # Nothing in the format, the keys or the stores either: they are what pulls numpy in.
    assert (
        _loaded(modules, ("chunkstore.format", "chunkstore.hashing", "chunkstore.backends")) == []
    )


def test_ls_of_a_directory_store_loads_no_heavy_module(good: GoodStore) -> None:
    out, modules = _run("ls", good.root)
    assert out.strip().endswith("8 chunks, 64.0 KiB")
    # The format and the keys load numpy on their first tensor or token array, not before.
    assert _loaded(modules, HEAVY) == []
    # A run that names its command builds that command's parser alone.
    assert _loaded(modules, ("chunkstore.cli.commands", "chunkstore.simulator")) == [
        "chunkstore.cli.commands"
    ]
    assert "chunkstore.cli.commands.ls" in modules
    assert "chunkstore.cli.commands.serve" not in modules
    assert _loaded(modules, STORE_SIDE) == []
