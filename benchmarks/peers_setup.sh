#!/usr/bin/env bash
# Benchmark venv for side-by-side runs against peer runtimes (never dflash dependencies):
# dflash itself (editable) plus ONNX Runtime GenAI. llama.cpp (`llama-cpp-python`, ~20 minutes of
# compiling on 2 cores) is added with PEERS_LLAMA_CPP=1.
#
#   bash benchmarks/peers_setup.sh            # -> .bench-venv (or $BENCH_VENV)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${BENCH_VENV:-.bench-venv}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e . onnxruntime-genai
if [ "${PEERS_LLAMA_CPP:-0}" = 1 ]; then
  "$VENV/bin/pip" install -q llama-cpp-python
fi
echo "ready: $VENV/bin/python benchmarks/peers_decode.py --pair PAIR_DIR --work WORK_DIR"
