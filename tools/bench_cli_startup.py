"""CLI start-up: ``chunkstore --help`` and ``chunkstore ls`` as whole processes, in seconds.

    .venv/bin/python tools/bench_cli_startup.py        # 20 runs of each (default)
    .venv/bin/python tools/bench_cli_startup.py 50     # more runs, steadier figures

Each command is a fresh ``python -m chunkstore.cli.main`` process running this
tree's code with its bytecode cached, timed from spawn to exit (output
discarded) after one untimed run.
``ls`` lists a temporary directory store of 8 small chunks, which it does
without decoding a payload. ``python -c pass`` is the interpreter's own
start-up, for scale. It prints min, median and max per command of the wall time
and of the CPU time (user + system, which other load on the machine disturbs
less); the goal is a median wall time of at most 0.3 s for both commands.
Numbers never fail the run.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chunkstore.backends._fs import FsStore
from chunkstore.testing.factories import sample_chunks

DEFAULT_RUNS = 20
GOAL_S = 0.3
ROOT = Path(__file__).resolve().parent.parent


def time_process(command: list[str], runs: int, env: dict[str, str]) -> tuple[list[float], ...]:
    """Wall and CPU (user + system) seconds of ``runs`` runs of ``command``, after one untimed
    run (which writes the .pyc files and warms the page cache); each must exit 0."""
    wall, cpu = [], []
    for _ in range(runs + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        # in the repository root, `python -m` finds this tree's chunkstore first
        subprocess.run(command, stdout=subprocess.DEVNULL, cwd=ROOT, env=env, check=True)
        wall.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return wall[1:], cpu[1:]


def _spread(values: list[float]) -> str:
    return f"{min(values):>6.3f} {statistics.median(values):>6.3f} {max(values):>6.3f}"


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_RUNS
    cli = [sys.executable, "-m", "chunkstore.cli.main"]
    with tempfile.TemporaryDirectory(prefix="chunkstore-bench-startup-") as tmp:
        store = str(Path(tmp) / "store")
        with FsStore(store, create=True) as fs:
            for chunk in sample_chunks(8):
                fs.put(chunk.key, chunk.data)
        # Bytecode cached as an installed package has it, kept out of the tree, whatever
        # PYTHONDONTWRITEBYTECODE says: compiling every module on every start is not start-up.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        cases = [
            ("python -c pass", [sys.executable, "-c", "pass"]),
            ("chunkstore --help", [*cli, "--help"]),
            ("chunkstore ls STORE", [*cli, "ls", store]),
        ]
        print(f"== start-up of whole processes, {runs} runs each (s; goal: median <= {GOAL_S}) ==")
        print(f"{'':<22} {'wall':^20}   {'cpu (user + sys)':^20}")
        columns = f"{'min':>6} {'median':>6} {'max':>6}"
        print(f"{'command':<22} {columns}   {columns}")
        for name, command in cases:
            wall, cpu = time_process(command, runs, env)
            print(f"{name:<22} {_spread(wall)}   {_spread(cpu)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
