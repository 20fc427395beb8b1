#!/usr/bin/env bash
# Benchmark venv for side-by-side runs against peer runtimes (never dflash dependencies):
# dflash itself (editable) plus ONNX Runtime GenAI. llama.cpp (`llama-cpp-python`, ~20 minutes of
# compiling on 2 cores) is added with PEERS_LLAMA_CPP=1; OpenVINO and NNCF (benchmarks/openvino_step_cost.py)
# with PEERS_OPENVINO=1. openvino-genai (benchmarks/ov_genai_worker.py) gets a venv of its own with
# PEERS_OPENVINO_GENAI=1: optimum-intel, its checkpoint converter, pins an older transformers than dflash's.
# llama.cpp's own llama-server (its DFlash; benchmarks/peers_dflash.py) is built with PEERS_LLAMA_CPP_BIN=1.
#
#   bash benchmarks/peers_setup.sh            # -> .bench-venv (or $BENCH_VENV)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${BENCH_VENV:-.bench-venv}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e . onnxruntime-genai
if [ "${PEERS_OPENVINO:-0}" = 1 ]; then
  "$VENV/bin/pip" install -q openvino==2026.4.1 nncf==3.4.0
fi
OV_ARG=""
if [ "${PEERS_OPENVINO_GENAI:-0}" = 1 ]; then
  OV=${BENCH_OV_VENV:-.bench-ov-venv}
  test -x "$OV/bin/python" || python3 -m venv "$OV"
  "$OV/bin/pip" install -q torch==2.13.0
  "$OV/bin/pip" install -q torch==2.13.0 "optimum-intel[openvino]==2.2.0" openvino==2026.4.1 \
    openvino-tokenizers==2026.4.1.0 openvino-genai==2026.4.1.0
  # optimum-intel pulls a torchvision built against another torch; transformers then fails to import.
  # Nothing here needs it (text models only).
  "$OV/bin/pip" uninstall -q -y torchvision
  OV_ARG=" --openvino-genai $OV/bin/python"
fi
LLAMA_ARG=""
if [ "${PEERS_LLAMA_CPP:-0}" = 1 ]; then
  "$VENV/bin/pip" install -q llama-cpp-python gguf sentencepiece
  # The converter to GGUF ships in llama.cpp's source tree (vendored in the sdist), not in the wheel.
  SRC=${LLAMA_CPP_SRC_DIR:-.bench-llama-src}
  if [ ! -f "$SRC"/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py ]; then
    mkdir -p "$SRC"
    "$VENV/bin/pip" download -q llama-cpp-python --no-deps --no-binary :all: -d "$SRC"
    tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC" --wildcards '*/vendor/llama.cpp/convert_hf_to_gguf.py' \
      '*/vendor/llama.cpp/gguf-py/*' '*/vendor/llama.cpp/conversion/*'
  fi
  LLAMA_ARG=" --llama-cpp $(ls -d "$SRC"/llama_cpp_python-*/vendor/llama.cpp | head -1)"
fi
if [ "${PEERS_LLAMA_CPP_BIN:-0}" = 1 ]; then
  # llama.cpp's own binaries (llama-server: its DFlash, `--spec-type draft-dflash`) from the same vendored tree,
  # for benchmarks/peers_dflash.py; ~10 minutes of compiling on 2 cores. Its converter needs sentencepiece.
  "$VENV/bin/pip" install -q sentencepiece
  SRC=${LLAMA_CPP_SRC_DIR:-.bench-llama-src}
  BUILD=${LLAMA_CPP_BUILD_DIR:-.bench-llama-build}
  mkdir -p "$SRC"
  ls "$SRC"/llama_cpp_python-*.tar.gz >/dev/null 2>&1 ||
    "$VENV/bin/pip" download -q llama-cpp-python --no-deps --no-binary :all: -d "$SRC"
  TREE=$(ls -d "$SRC"/llama_cpp_python-*/ 2>/dev/null | head -1)
  if [ ! -f "$TREE/vendor/llama.cpp/CMakeLists.txt" ]; then
    tar xzf "$SRC"/llama_cpp_python-*.tar.gz -C "$SRC"
    TREE=$(ls -d "$SRC"/llama_cpp_python-*/ | head -1)
  fi
  cmake -S "$TREE/vendor/llama.cpp" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
  cmake --build "$BUILD" -j2 --target llama-server llama-quantize
  echo "ready: $VENV/bin/python benchmarks/peers_dflash.py --work WORK_DIR --llama-bin $BUILD/bin" \
    "--llama-src $TREE/vendor/llama.cpp$OV_ARG"
fi
echo "ready: $VENV/bin/python benchmarks/peers_decode.py --pair PAIR_DIR --work WORK_DIR$LLAMA_ARG$OV_ARG"
