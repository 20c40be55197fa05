#!/usr/bin/env bash
# Create the project's virtual environment and install chunkstore with its test extras,
# from this repository's own files. Called by `make install` (and so by demo/test/bench).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
cd "$(dirname "$0")/.."
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip
"${PIP[@]}" install -e '.[test,dev]'
