# Two commands on a fresh machine:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/dyad: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/dyad

.PHONY: demo test install lint readme
install: $(BIN)/dyad

demo: $(BIN)/dyad
	$(BIN)/dyad demo

test: $(BIN)/dyad
	bash scripts/setup_test_deps.sh
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(BIN)/dyad
	$(BIN)/ruff check orchestrator adapters tests

# Refresh the generated reference sections of README.md (config, CLI, metrics) from the code.
readme: $(BIN)/dyad
	$(BIN)/python scripts/gen_reference.py
