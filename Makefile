# chunkstore: `make demo`, `make test`, `make bench` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp

.PHONY: install demo test test-vllm033 bench bench-rivals lint lint-only docs docs-only clean

install: $(STAMP)

# One virtual environment for everything; reinstalled when the project's dependency files change.
$(STAMP): pyproject.toml tools/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash tools/install.sh
	touch $(STAMP)

# The second test environment: the regular vllm==0.33.0 wheel (no vllm._C CPU kernels), its own venv.
PYTHON311 ?= python3.11
VENV033 ?= .venv-vllm033
STAMP033 := $(VENV033)/.installed-stamp
VLLM033_ENV := VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 CHUNKSTORE_REQUIRE_VLLM033=1

$(STAMP033): pyproject.toml tools/install_vllm033.sh
	PYTHON=$(PYTHON311) VENV=$(VENV033) bash tools/install_vllm033.sh
	touch $(STAMP033)

# tests/vllm without the real-engine and kernel tests, plus the native tier tests. Exit code 5
# (nothing collected) fails the target like any other non-zero code.
test-vllm033: $(STAMP033)
	$(VLLM033_ENV) $(VENV033)/bin/python -m pytest -p no:cacheprovider -m "not vllm_kernels" \
		tests/vllm tests/vllm033

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

# chunkstore against vLLM's and LMCache's filesystem tiers; the rivals live in .venv-bench.
BENCH_STAMP := .venv-bench/.installed-stamp

bench-rivals: install $(BENCH_STAMP)
	$(BIN)/python tools/bench_rivals.py

$(BENCH_STAMP): tools/install_rivals.sh pyproject.toml
	bash tools/install_rivals.sh
	touch $(BENCH_STAMP)

lint: install lint-only

# ruff over everything, mypy over the whole package (strict on the format and key modules, see
# pyproject.toml), run before the tests.
lint-only:
	$(BIN)/ruff check chunkstore tests tools
	$(BIN)/ruff format --check chunkstore tests tools
	$(BIN)/mypy chunkstore

docs: install docs-only

# The manual (docs/, mkdocs.yml), built strictly: a broken link or anchor, a page missing from the
# nav or an unresolvable API name fails. Not --quiet: it would hide the warnings strict counts.
docs-only:
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(VENV033) .venv-bench build *.egg-info .pytest_cache .hypothesis
