#!/usr/bin/env bash
# A venv of its own for a load client no one here wrote: GuideLLM (vLLM project's OpenAI-compatible serving
# benchmark, PyPI `guidellm`). Never a dflash dependency; benchmarks/serve_guidellm.py drives it.
# torch is installed first, pinned to the local CPU build: guidellm requires torch, and unpinned pip pulls CUDA's.
#
#   bash benchmarks/client_setup.sh            # -> .client-venv (or $CLIENT_VENV)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${CLIENT_VENV:-.client-venv}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q guidellm==0.8.1
echo "ready: .venv/bin/python benchmarks/serve_guidellm.py --client-venv $VENV"
