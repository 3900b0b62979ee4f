# One command sets up and runs the demonstration; one sets up and runs every test.
#   make demo    make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint bench docs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	# torchtitan's models and trainer for tests/test_torchtitan.py: --no-deps (it pins spmd_types==0.2.3, our
	# distribution name), plus the small pure-Python modules they import at module level; tokenizers,
	# datasets, tensorboard and triton are stubbed in tests/_torchtitan_support.py
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 torchdata==0.11.0
	touch $@

demo: setup
	$(BIN)/python examples/quickstart.py

lint: setup
	$(BIN)/ruff check spmd_types tests examples benchmarks docs

test: setup lint docs
	$(BIN)/python -m pytest

# The documentation site, into site/ (a broken link or a public name without a docstring fails it).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: setup
	$(BIN)/python benchmarks/overhead.py
