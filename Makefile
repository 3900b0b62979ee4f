# One command sets up and runs the demonstration; one sets up and runs every test.
#   make demo    make test
# Supported torch releases are the ones `make test` runs the suite on: 2.13.0 (.venv, CPU build) and 2.14.1
# (.venv214, a CUDA build that runs on the CPU; torch 2.14 itself calls this package from FSDP2 and local_map).
PYTHON ?= python3
VENV := .venv
VENV214 := .venv214
BIN := $(VENV)/bin
BIN214 := $(VENV214)/bin
# torchtitan's models and trainer for tests/test_torchtitan.py: --no-deps (it pins spmd_types==0.2.3, our
# distribution name), plus the small pure-Python modules they import at module level; tokenizers, datasets,
# tensorboard and triton are stubbed in tests/_torchtitan_support.py
TORCHTITAN := torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 torchdata==0.11.0
TRAINER_DEPS := tokenizers 'datasets>=3.6.0,<4.8.0' tensorboard typeguard

.PHONY: setup setup214 demo test test213 test214 lint bench docs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,docs]'
	$(BIN)/pip install -q --no-deps $(TORCHTITAN)
	touch $@

setup214: $(VENV214)/.installed

$(VENV214)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV214)
	$(BIN214)/pip install -q --upgrade pip
	$(BIN214)/pip install -q torch==2.14.1
	$(BIN214)/pip install -q -e '.[test,docs]'
	$(BIN214)/pip install -q --no-deps $(TORCHTITAN)
	# what torchtitan's own trainer imports (tests/test_torchtitan_trainer.py runs `torchtitan.train` under torchrun)
	$(BIN214)/pip install -q $(TRAINER_DEPS)
	touch $@

demo: setup
	$(BIN)/python examples/quickstart.py

lint: setup
	$(BIN)/ruff check spmd_types tests examples benchmarks docs

# The whole suite on torch 2.14.1; on 2.13.0 all but the end-to-end files in ONLY_214.
test: setup setup214 lint docs test214 test213

test214: setup214
	$(BIN214)/python -m pytest

# torch 2.13.0 runs everything but these end-to-end files (about 15 of CI's minutes; they run on 2.14.1):
# the torchtitan trainer, FSDP, compile and equivalence runs, Megatron-core's models, the fuzzer, the examples.
ONLY_214 := test_torchtitan_trainer test_torchtitan_fsdp test_torchtitan_compile test_torchtitan_equivalence test_equivalence_fsdp \
	test_fsdp_spmd test_torch_untouched test_equivalence_megatron test_equivalence_gpt test_megatron_moe \
	test_megatron_compile test_megatron_core test_fuzz test_examples test_dtensor_model test_dp_recipes \
	test_compile_typed test_docs_site

test213: setup
	$(BIN)/python -m pytest $(foreach f,$(ONLY_214),--ignore=tests/$(f).py)

# The documentation site, into site/ (a broken link or a public name without a docstring fails it).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: setup
	$(BIN)/python benchmarks/overhead.py
