# Routine tasks. `make install` is idempotent: the stamp is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install test lint format

install: $(STAMP)

# torch first and pinned: 2.13.0 is the CPU build on local disk; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[dev]'
	touch $(STAMP)

test: install
	$(VENV)/bin/python -m pytest -q

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
