# Two commands do everything from a fresh clone: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1
# Doctests: the `>>>` examples of the library's modules (all pure: none needs a process group).
DOCTESTS := --doctest-modules lightning_gossip

.PHONY: setup demo test test-fast lint docs bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m recipes.asr.demo

# Everything: unit tests, doctests, the multi-process fits, the recipes' smoke runs.
test: setup
	$(PY) -m pytest -q --durations=25 $(DOCTESTS) tests

# The inner loop: no process launches (LG_NO_LAUNCH=1 makes a launch fail loudly), doctests.
test-fast: setup
	LG_NO_LAUNCH=1 $(PY) -m pytest -q -m "not multiprocess" $(DOCTESTS) tests

# ruff (E501 included), a docstring on every public name, the API reference in strict mode.
lint: setup
	.venv/bin/ruff check .
	$(PY) scripts/check_docstrings.py
	$(PY) -m mkdocs build --strict --quiet --site-dir site

# The documentation with the API reference, as a static site in site/.
docs: setup
	$(PY) -m mkdocs build --strict --site-dir site

bench: setup
	$(PY) benchmarks/step_time.py
