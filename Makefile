# Two entry points for a fresh machine with Python 3.11+: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/activate: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/activate

.PHONY: serve test test-all
serve: $(BIN)/activate
	$(BIN)/python -m ernie_jax.serve --mesh 8

test: $(BIN)/activate
	$(BIN)/python -m pytest -q

test-all: $(BIN)/activate
	$(BIN)/python -m pytest -q -m ""
