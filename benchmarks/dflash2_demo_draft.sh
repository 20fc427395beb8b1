#!/usr/bin/env bash
# A DFlash2 draft for the shipped demo target, trained exactly as the shipped DFlash draft was (Makefile's
# demo-models: same data, seeds, steps and learning rates; resumable), then set beside it in one bench run.
#   bash benchmarks/dflash2_demo_draft.sh [WORK_DIR]     (about an hour of training on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-.demo-work-v2}
PY=.venv/bin/python
TARGET=dflash_cli/shipped/models/demo-target
V2=(--dflash2 --selector-rank 64 --selector-top-k 16)
$PY -m dflash_cli.demo.train_draft --threads 2 --target $TARGET --work-dir "$WORK/phase1" --out "$WORK/draft-phase1" "${V2[@]}"
$PY -m dflash_cli.demo.train_draft --threads 2 --target $TARGET --work-dir "$WORK/doc" \
  --init-from "$WORK/draft-phase1" --prompt-style docstring --prompt-lens 64,96,128,192 \
  --n-seqs 6144 --lr 1e-3 --steps 2000 --out "$WORK/demo-draft2" "${V2[@]}"
echo "trained: $WORK/demo-draft2"
