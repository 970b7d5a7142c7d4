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
	$(BIN)/pip install -q --no-compile -c constraints.txt torch -e '.[dev,bench]'
	# Bytecode once, on every core (pip compiles on one: ~35 s -> ~20 s on 2 cores); these
	# machines set PYTHONDONTWRITEBYTECODE, so without it every process compiles its imports.
	# Some packages ship modules for newer Pythons that cannot compile (pip skips them too).
	$(BIN)/python -m compileall -qq -j0 $(VENV)/lib pipeline trainer_client || true
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
