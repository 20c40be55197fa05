# chunkstore: `make demo`, `make test`, `make bench` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench bench-rivals lint lint-only clean

install: $(STAMP)

# One virtual environment for everything; reinstalled when the project's dependency files change.
$(STAMP): pyproject.toml tools/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash tools/install.sh
	touch $(STAMP)

demo: install
	$(BIN)/chunkstore demo

test: install lint-only
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python tools/run_benchmarks.py

# chunkstore against vLLM's and LMCache's filesystem tiers; the rivals live in .venv-bench.
BENCH_STAMP := .venv-bench/.installed-stamp

bench-rivals: install $(BENCH_STAMP)
	$(BIN)/python tools/bench_rivals.py

$(BENCH_STAMP): tools/install_rivals.sh pyproject.toml
	bash tools/install_rivals.sh
	touch $(BENCH_STAMP)

lint: install lint-only

# ruff over everything, mypy strict on the format and key modules (run before the tests).
lint-only:
	$(BIN)/ruff check chunkstore tests tools
	$(BIN)/ruff format --check chunkstore tests tools
	$(BIN)/mypy chunkstore/format chunkstore/hashing

clean:
	rm -rf $(VENV) .venv-bench build *.egg-info .pytest_cache .hypothesis
