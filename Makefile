# Two entry points for a fresh machine with Python 3.11+: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/activate: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile -e ".[test]"
	@# Bytecode for every package, compiled once on all cores (pip's own pass runs on one). Where
	@# PYTHONDONTWRITEBYTECODE is set, imports never write .pyc: without this step every process compiled
	@# jax, flax, fastapi and the package from source again (3 s of each server's start). A file that does not
	@# compile (a newer Python's syntax in a test helper) is one that no import loads.
	-$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib ernie_jax
	touch $(BIN)/activate

.PHONY: serve test test-all
serve: $(BIN)/activate
	$(BIN)/python -m ernie_jax.serve --mesh 8

# Two worker processes, each taking whole files (module-scoped servers and engines stay in one process): one
# process leaves a core idle while it runs Python between compiles.
test: $(BIN)/activate
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=20

# Every case, slow ones included: one pytest process per file, so compiled programs and engines do not pile
# up in one process (the whole suite in one process outgrew this 24 GB, 2-core machine).
test-all: $(BIN)/activate
	@status=0; for f in tests/test_*.py; do $(BIN)/python -m pytest -q -m "" $$f || status=1; done; exit $$status
