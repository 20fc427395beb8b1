"""Hybrid vs prompt lookup, paired per prompt, from a `dflash bench` results JSONL.

Both modes run on the same prompts in the same minute, so the per-prompt ratio of decode times
cancels most of the machine's drift; the mean of log ratios gives a geometric mean and its 95% CI.

    python benchmarks/hybrid_vs_lookup.py ~/.cache/dflash/bench/demo-humaneval-b8.jsonl --last 164
"""

from __future__ import annotations

import argparse
import json
import math
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="the bench's per-sample JSONL (the path `dflash bench` prints as `results`)")
    ap.add_argument("--last", type=int, default=0, help="only the last N samples that ran both modes (0: all)")
    args = ap.parse_args()
    rows = []
    with open(args.results) as f:
        for line in f:
            row = json.loads(line)
            res = row.get("results")
            if isinstance(res, dict) and "pld" in res:  # logs written before the rename call lookup "pld"
                res["lookup"] = res.pop("pld")
            if isinstance(res, dict) and "hybrid" in res and "lookup" in res and res["hybrid"]["decode_s"] > 0:
                rows.append(res)
    rows = rows[-args.last :] if args.last else rows
    if len(rows) < 2:
        raise SystemExit("need at least two samples that ran both lookup and hybrid (bench --modes lookup,hybrid)")
    logs = [math.log(r["lookup"]["decode_s"] / r["hybrid"]["decode_s"]) for r in rows]
    mean, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    total = sum(r["lookup"]["decode_s"] for r in rows) / sum(r["hybrid"]["decode_s"] for r in rows)
    low, high = math.exp(mean - 1.96 * se), math.exp(mean + 1.96 * se)
    print(
        f"hybrid vs prompt lookup (decode speed): total-time ratio {total:.3f}, "
        f"geometric mean per prompt {math.exp(mean):.3f} [{low:.3f}, {high:.3f}], n={len(rows)}"
    )


if __name__ == "__main__":
    main()
