#!/usr/bin/env bash
# Every measurement quoted for the shipped demo pair, in one run (about 20 minutes on 2 cores):
#   bash benchmarks/demo_measurements.sh
# Writes benchmarks/results/{demo-build.txt, demo-humaneval.json, demo-check.json, verify_cost_demo.json}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=benchmarks/results
mkdir -p "$out"
export DFLASH_HOME="${DFLASH_HOME:-$(mktemp -d)}"   # a fresh cache: the cold build is part of the record
dflash=.venv/bin/dflash

{ /usr/bin/time -f "cold build: %e s" $dflash build --recipe demo >/dev/null; } 2>&1 | tail -1 | tee "$out/demo-build.txt"
{ /usr/bin/time -f "warm build: %e s" $dflash build --recipe demo >/dev/null; } 2>&1 | tail -1 | tee -a "$out/demo-build.txt"
$dflash bench --recipe demo --dataset humaneval --max-new-tokens 128 --output "$out/demo-humaneval.json"
$dflash check --recipe demo --fp16-prompts 164 --max-new-tokens 128 --json >"$out/demo-check.json" || true
.venv/bin/python benchmarks/verify_cost.py --recipe demo --out "$out/verify_cost_demo.json"
