#!/usr/bin/env bash
# Side by side on one checkpoint: ONNX Runtime GenAI's model builder (fp32, CPU) vs `dflash build`
# (all stages, fp32), each under /usr/bin/time -v, alternating, REPEAT times. The builder lives in its
# own venv (never a dflash dependency); this script creates it on first use.
#
#   bash benchmarks/genai_builder_compare.sh [PAIR_ROOT] [REPEAT]
#   (PAIR_ROOT defaults to /work/pairs/qwen3-0.6b, made by benchmarks/random_pairs.py; WARMUP=1 runs
#   one uncounted round of each first: the first round after other work pays cold caches; SYNC=1 flushes
#   the previous run's dirty pages before each timed run; IDLE=S waits S seconds between removing a
#   tool's previous output and its next run)
#
# Each tool's previous output is removed right before its own run, the same way for both. It matters
# on VMs that hand freed memory back to their host (free page reporting, as here): pages freed a
# moment ago are reused cheaply, pages freed seconds ago must be faulted in from the host again. This
# script used to remove both outputs before the builder's run, so the builder reused ~5.7 GB of just-
# freed page cache while `dflash build` started after a sync, on returned pages: measured one after
# the other, the builder took 8.9-10.6 s right after a removal and 13.2-13.9 s after 15 s idle
# (system time 3.1-4.4 s against 7.2-7.5 s); `dflash build` 15.0-15.2 s against 17.9-19.4 s
# (benchmarks/results/scale/genai-builder-compare.txt). IDLE=15 gives both the slow case.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PAIR=${1:-/work/pairs/qwen3-0.6b}
REPEAT=${2:-2}
VENV=${BENCH_VENV:-.bench-venv}
WORK=${WORK:-/work/genai-compare}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q onnxruntime-genai "transformers>=5.20,<6" onnx onnx_ir onnxscript safetensors
fi
test -d "$PAIR/target" || .venv/bin/python benchmarks/random_pairs.py qwen3-0.6b "$(dirname "$PAIR")"

mkdir -p "$WORK"
cat > "$WORK/recipe.yaml" <<EOF
name: genai-compare
family: $(python3 -c "import json;print(json.load(open('$PAIR/target/config.json'))['model_type'])")
target: {path: $PAIR/target}
draft: {path: $PAIR/draft}
export: {ctx_len: 4096, prefill_seq_len: 128}
EOF

measure() {  # label, command...
  local label=$1; shift
  /usr/bin/time -v "$@" > "$WORK/$label.out" 2> "$WORK/$label.err" || { tail -20 "$WORK/$label.err"; exit 1; }
  local wall rss
  wall=$(grep "Elapsed (wall clock)" "$WORK/$label.err" | awk '{print $NF}')
  rss=$(grep "Maximum resident set size" "$WORK/$label.err" | awk '{printf "%.2f", $NF/1048576}')
  echo "$label wall=$wall peak_rss_gib=$rss" | tee -a "$WORK/results.txt"
}

: > "$WORK/results.txt"
fresh() {  # remove a tool's previous output right before its next run (see above)
  # SYNC=1: first flush the previous run's written files to disk (untimed), so neither tool's run pays
  # for the other's writeback of 2-3 GB (neither tool fsyncs its output).
  [ "${SYNC:-0}" = 1 ] && sync
  rm -rf "$@"
  [ -n "${IDLE:-}" ] && sleep "$IDLE"
  return 0
}

for i in $(seq 1 "${WARMUP:-0}"); do
  fresh "$WORK/genai-out" "$WORK/genai-cache"
  "$VENV/bin/python" -m onnxruntime_genai.models.builder -i "$PAIR/target" -o "$WORK/genai-out" -p fp32 -e cpu \
    -c "$WORK/genai-cache" > /dev/null 2>&1
  fresh "$WORK/dflash-cache"
  .venv/bin/dflash build --recipe "$WORK/recipe.yaml" --cache-dir "$WORK/dflash-cache" --json > /dev/null 2>&1
done
for i in $(seq 1 "$REPEAT"); do
  fresh "$WORK/genai-out" "$WORK/genai-cache"
  measure "genai-fp32-$i" "$VENV/bin/python" -m onnxruntime_genai.models.builder \
    -i "$PAIR/target" -o "$WORK/genai-out" -p fp32 -e cpu -c "$WORK/genai-cache"
  fresh "$WORK/dflash-cache"
  measure "dflash-build-fp32-$i" .venv/bin/dflash build --recipe "$WORK/recipe.yaml" --cache-dir "$WORK/dflash-cache" --json
done
rm -rf "$WORK/genai-out" "$WORK/genai-cache" "$WORK/dflash-cache"
cat "$WORK/results.txt"
python3 - "$WORK/results.txt" <<'PY'
import statistics, sys
secs = {"genai": [], "dflash": []}
for line in open(sys.argv[1]):
    label, wall = line.split()[0], line.split()[1].removeprefix("wall=")
    seconds = 0.0
    for part in wall.split(":"):  # [h:]m:s
        seconds = 60 * seconds + float(part)
    secs["genai" if label.startswith("genai") else "dflash"].append(seconds)
g, d = statistics.median(secs["genai"]), statistics.median(secs["dflash"])
print(f"medians: genai {g:.2f} s, dflash build {d:.2f} s, ratio {d / g:.2f}x")
PY
