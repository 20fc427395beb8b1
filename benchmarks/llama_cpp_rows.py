"""llama.cpp's cost of one call of B tokens after a cached prompt: its T(B) curve, beside dflash's (issue 56).

    .bench-venv/bin/python benchmarks/llama_cpp_rows.py --pair /work/pairs/qwen3-4b --work WORK \
        --llama-cpp .bench-llama-src/llama_cpp_python-*/vendor/llama.cpp [--quant q4_0] [--lengths 1,2,4,8,16]
        [--start 100] [--reps 9] [--out F.json]

The pair's target is converted to GGUF and quantised by llama.cpp's own tools (benchmarks/peers_decode.py),
then a `start`-token prompt is read once and every round evaluates B tokens at that position for each B
in turn (the cache rewound to `start` before each call), with logits for every row, as a verify call
needs. Medians in ms, the ratio to T(1), and ms per added row. Run it from the benchmark venv
(benchmarks/peers_setup.sh with PEERS_LLAMA_CPP=1); threads = cores, as dflash's sessions use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers_decode import llama_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (its converter)")
    ap.add_argument("--quant", default="q4_0")
    ap.add_argument("--outtype", default="bf16", help="GGUF the converter writes first (f32, bf16)")
    ap.add_argument("--lengths", default="1,2,4,8,16")
    ap.add_argument("--start", type=int, default=100)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import llama_cpp
    import numpy as np

    args.work.mkdir(parents=True, exist_ok=True)
    path = llama_model(args.pair, args.work, args.llama_cpp, args.quant, args.outtype)
    llm = llama_cpp.Llama(
        str(path),
        n_ctx=512,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,  # a verify call reads every row's logits
        verbose=False,
    )
    rng = np.random.default_rng(0)
    vocab = llm.n_vocab()
    prompt = rng.integers(10, vocab - 10, args.start).tolist()
    llm.eval(prompt)
    lengths = [int(b) for b in args.lengths.split(",")]
    rows = {b: rng.integers(10, vocab - 10, b).tolist() for b in lengths}
    times: dict[int, list[float]] = {b: [] for b in lengths}
    for rep in range(args.reps + 1):  # the first round warms up
        for b in lengths:
            llm.n_tokens = args.start  # eval drops the cache past n_tokens before it writes
            t0 = time.perf_counter()
            llm.eval(rows[b])
            if rep:
                times[b].append(time.perf_counter() - t0)
    med = {b: statistics.median(t) * 1e3 for b, t in times.items()}
    first = lengths[0]
    report = {
        "engine": f"llama.cpp {args.quant} (llama-cpp-python {llama_cpp.__version__})",
        "pair": str(args.pair),
        "start": args.start,
        "threads": args.threads,
        "T_ms": {b: round(m, 1) for b, m in med.items()},
        "T_over_T1": {b: round(m / med[first], 2) for b, m in med.items()},
        "ms_per_added_row": round((med[lengths[-1]] - med[first]) / (lengths[-1] - first), 1),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
