# `make test` on a fresh machine: create .venv, install pinned deps (torch first, CPU build), run pytest.
# `make lint`: ruff (with bugbear) and mypy, configured in pyproject.toml.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: setup test test-all lint serve bench bench-engine bench-ttft

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

test: setup
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

test-all: setup
	$(BIN)/python -m pytest -m "not gpu"

serve: setup
	$(BIN)/hybridserve serve --host 127.0.0.1 --port $(or $(PORT),8000)

bench: setup
	$(BIN)/python -m benchmarks.kernels

bench-engine: setup
	$(BIN)/python -m benchmarks.engine

bench-ttft: setup
	$(BIN)/python -m benchmarks.ttft_1m
