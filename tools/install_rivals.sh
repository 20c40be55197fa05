#!/usr/bin/env bash
# The rivals `make bench-rivals` measures chunkstore against, in their own virtual environment
# (.venv-bench, ignored by git): vLLM 0.33.0 (its fs offloading tier; the regular wheel, run on
# the CPU with VLLM_TARGET_DEVICE=cpu) and LMCache 0.5.6 (its fs and fs_native L2 adapters),
# plus chunkstore itself (editable, with its core dependencies). Several GB; minutes.
set -euo pipefail
PYTHON=${RIVALS_PYTHON:-python3.11}  # LMCache 0.5.6 and vLLM 0.33.0 publish cp311 wheels
VENV=${BENCH_VENV:-.venv-bench}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install 'vllm==0.33.0' 'lmcache==0.5.6'
"${PIP[@]}" install -e .
