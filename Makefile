# chunkstore: `make demo`, `make test`, `make bench` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench lint lint-only clean

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

lint: install lint-only

# ruff over everything, mypy strict on the format and key modules (run before the tests).
lint-only:
	$(BIN)/ruff check chunkstore tests tools
	$(BIN)/ruff format --check chunkstore tests tools
	$(BIN)/mypy chunkstore/format chunkstore/hashing

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
