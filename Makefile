# Two commands do everything from a fresh clone: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1
# make test runs on this many pytest-xdist workers (the multi-process tests wait more than
# they compute); TEST_WORKERS=0 runs in one process. A file runs on one worker (loadfile); the
# workers take the files in the order tests/conftest.py gives them, the longest first
# (--no-loadscope-reorder: xdist's own order, the files with the most tests first, started the
# long launch files last).
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# Doctests: the `>>>` examples of the library's modules (all pure: none needs a process group),
# and of benchmarks/ and testbed/ (the race's scoring and rules among them; importing those
# modules starts nothing and edits no sys.path: tests/test_benchmarks_layout.py).
DOCTESTS := --doctest-modules lightning_gossip benchmarks testbed

.PHONY: setup bytecode demo test test-slow test-all test-fast lint docs bench

setup:
	@bash scripts/setup.sh

# Python bytecode for the venv (once per install) and the repository. uv installs no .pyc files
# and with PYTHONDONTWRITEBYTECODE set Python writes none either: every process of a test launch
# (about 200 in `make test`) then compiles torch and Lightning again, about 10 s of CPU each.
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
bytecode: setup
	@if [ ! .venv/.bytecode-compiled -nt .venv/.lightning-gossip-installed ]; then \
	  echo "[setup] compiling the Python bytecode of .venv/ (once, about a minute)"; \
	  $(PY) -m compileall -q -j 0 $(SITE) >/dev/null || true; \
	  touch .venv/.bytecode-compiled; fi
	@$(PY) -m compileall -q lightning_gossip tests recipes benchmarks testbed >/dev/null || true

demo: setup
	$(PY) -m recipes.asr.demo

# Unit tests, doctests, the multi-process fits, every fault kind, the recipes' smoke runs; not
# the tests marked `slow` (pyproject.toml's addopts deselects them). About 20 minutes on the idle
# machine (tests/README.md).
test: bytecode
	$(PY) -m pytest -q $(XDIST) --durations=25 $(DOCTESTS) tests

# The tests marked `slow`: the seeded fuzz subset, soak runs, benchmark smoke runs (tests/README.md).
test-slow: bytecode
	$(PY) -m pytest -q $(XDIST) --durations=25 -m slow tests

# Both of the above in one run.
test-all: bytecode
	$(PY) -m pytest -q $(XDIST) --durations=25 -m "slow or not slow" $(DOCTESTS) tests

# The inner loop: no process launches (LG_NO_LAUNCH=1 makes a launch fail loudly), doctests;
# on one xdist worker per core (FAST_WORKERS=0: in one process).
FAST_WORKERS ?= 2
test-fast: bytecode
	LG_NO_LAUNCH=1 $(PY) -m pytest -q -n $(FAST_WORKERS) --dist loadfile --durations=10 \
		-m "not multiprocess and not slow" $(DOCTESTS) tests

# ruff (E501 included), a docstring on every public name, the API reference in strict mode.
lint: setup
	.venv/bin/ruff check .
	$(PY) scripts/check_docstrings.py
	$(PY) -m mkdocs build --strict --quiet --site-dir site

# The documentation with the API reference, as a static site in site/.
docs: setup
	$(PY) -m mkdocs build --strict --site-dir site

bench: setup
	$(PY) -m benchmarks.perf.step_time

.PHONY: test-latest test-wheel

# The library's tests on the newest torch and Lightning (torch 2.15.0, lightning 2.6.6,
# torchvision 0.29.2; no torchaudio, so the ASR recipe's torchaudio tests skip) in .venv-latest/,
# created once with uv (--no-config: pyproject's constraint-dependencies pin 2.9.1).
# LATEST_PYTEST_ARGS replaces the pytest selection (default: make test's).
test-latest:
	@bash scripts/test_latest.sh

# The wheel on its own: build it, install it into a clean venv outside the repository, run
# `lightning-gossip --help` and a 2-rank fit under each strategy there (no PYTHONPATH).
test-wheel:
	@bash scripts/test_wheel.sh
