# One obvious way: `make demo` (sets up, then runs the demo) and `make test`.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint proto bench clean

$(BIN)/odb-pipeline: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# One resolve, torch pinned (constraints.txt): this machine carries the CPU build; an
	# unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q -c constraints.txt torch -e '.[dev,bench]'
	@touch $@

setup: $(BIN)/odb-pipeline

demo: setup
	$(BIN)/odb-pipeline demo

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .

proto: setup
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
