"""Run every ``tools/bench_*.py`` in turn (what ``make bench`` does); each prints its own ratios.

Benchmarks report numbers; they never fail on a threshold. A benchmark whose
optional dependency is missing says so and is skipped. ``bench_native_tier.py`` needs vLLM 0.33:
it re-runs itself in ``.venv-vllm033`` when that exists (``make test-vllm033`` builds it) and
otherwise prints how to get it. ``bench_events.py`` (KV event lag and loss) needs pyzmq and
msgpack.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    tools = Path(__file__).resolve().parent
    only = set(sys.argv[1:])
    failed = []
    for script in sorted(tools.glob("bench_*.py")):
        if only and script.stem not in only and script.stem.removeprefix("bench_") not in only:
            continue
        print(f"\n=== {script.name} ===", flush=True)
        if subprocess.call([sys.executable, str(script)]) != 0:
            failed.append(script.name)
    if failed:
        print(f"\nbenchmarks that crashed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
