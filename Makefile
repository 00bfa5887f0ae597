# Two commands do everything from a fresh clone: `make demo` and `make test`.
SHELL := /bin/bash
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test lint bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m recipes.asr.demo

test: setup
	$(PY) -m pytest -q tests

lint: setup
	.venv/bin/ruff check .

bench: setup
	$(PY) benchmarks/step_time.py
