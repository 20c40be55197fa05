# chunkstore: `make demo`, `make test`, `make bench` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp

.PHONY: install demo test bench lint lint-only docs docs-only clean

install: $(STAMP)

# One virtual environment for everything; reinstalled when the project's dependency files change.
$(STAMP): pyproject.toml tools/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash tools/install.sh
	touch $(STAMP)

# The demo needs only the core and the peer extra: no vLLM, torch or NIXL (a fresh machine runs it
# in well under a minute). A full install satisfies it too.
$(DEMO_STAMP): pyproject.toml tools/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) CHUNKSTORE_PROFILE=demo bash tools/install.sh
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/chunkstore demo

test: install lint-only docs-only
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python tools/run_benchmarks.py

lint: install lint-only

# ruff over everything, mypy strict on the format and key modules (run before the tests).
lint-only:
	$(BIN)/ruff check chunkstore tests tools
	$(BIN)/ruff format --check chunkstore tests tools
	$(BIN)/mypy chunkstore/format chunkstore/hashing

docs: install docs-only

# The manual (docs/, mkdocs.yml), built strictly: a broken link or anchor, a page missing from the
# nav or an unresolvable API name fails. Not --quiet: it would hide the warnings strict counts.
docs-only:
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
