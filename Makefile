# Routine tasks. `make install` is idempotent: the stamp is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint format demo demo-models bench-demo verify-cost

install: $(STAMP)

# torch first and pinned: 2.13.0 is the CPU build on local disk; an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip uninstall -y -q dflash 2>/dev/null || true  # the distribution's old name
	$(VENV)/bin/pip install -e '.[dev]'
	touch $(STAMP)

# Two workers, each test file on one of them (its module fixtures are built once): most of the suite's
# time is single-threaded tracing, so two files at once take about half the time on two cores.
test: install
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

# The edit loop: everything but the tests marked slow (pair exports and builds). CI runs `make test`.
test-fast: install
	$(VENV)/bin/python -m pytest -q -m "not slow and not qaic"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The main job: build the shipped demo pair with ONNX Runtime and generate with DFlash.
demo: install
	$(VENV)/bin/dflash build --recipe demo
	$(VENV)/bin/dflash run --recipe demo --prompt "def fibonacci(n):"

# Rebuild tokenizer, target and draft from scratch (fixed seeds; about 2 hours on 2 CPU cores).
# Resumable: re-running continues from the checkpoints in .demo-work/. The draft is trained in two
# phases: on continuations of prompts cut at any line end, then warm-started and trained further on
# continuations of prompts cut where a docstring closes (how HumanEval-style prompts end).
demo-models: install
	$(VENV)/bin/python -m dflash_cli.demo.train_target --steps 1600 --threads 2
	$(VENV)/bin/python -m dflash_cli.demo.train_draft --threads 2 --out .demo-work/draft-phase1
	$(VENV)/bin/python -m dflash_cli.demo.train_draft --threads 2 --work-dir .demo-work/draft-doc \
	  --init-from .demo-work/draft-phase1 --prompt-style docstring --prompt-lens 64,96,128,192 \
	  --n-seqs 6144 --lr 1e-3 --steps 2000 --out models/demo-draft

bench-demo: install
	$(VENV)/bin/dflash bench --recipe demo --dataset humaneval --output benchmarks/results/demo-humaneval.json

verify-cost: install
	$(VENV)/bin/python benchmarks/verify_cost.py
