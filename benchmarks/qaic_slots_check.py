"""Check: a QAIC continuous-batching export (compile.qaic.full_batch_size) at a real shape, run by ONNX Runtime.

    .venv/bin/python benchmarks/qaic_slots_check.py --recipe q06.yaml --slots 4 [--cache-dir DIR]

Exports the pair with `compile.backend=qaic` and `compile.qaic.full_batch_size=SLOTS` (no SDK needed), runs
`dflash check`'s readiness report on the "_cb" graphs, then on ONNX Runtime fills every slot alone with a prompt
of its own length (one prefill chunk) and runs two verify blocks and a one-token step with every slot in
each call, comparing each sequence's outputs with the one-sequence graph's (same calls, its own cache).
Prints the largest differences (0 means bit-equal) and the seconds of each kind of call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--cache-dir")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import onnxruntime as ort

    from dflash_cli.cache.store import Cache
    from dflash_cli.readiness import readiness_report
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import artifact_path, build

    recipe = load_recipe(args.recipe, ["compile.backend=qaic", f"compile.qaic.full_batch_size={args.slots}"])
    cache = Cache(args.cache_dir)
    t0 = time.perf_counter()
    build(recipe, cache, upto="export")
    export = artifact_path(recipe, cache, "export")
    info = json.loads((export / "export.json").read_text())
    doc: dict = {"recipe": args.recipe, "slots": args.slots, "export_s": round(time.perf_counter() - t0, 1)}
    report = readiness_report(export)
    doc["readiness"] = {
        g.graph: {
            "onnx": Path(g.onnx).name,
            "unsupported_ops": g.unsupported_ops,
            "non_static": sum(len(s.non_static) for s in g.shapes),
        }
        for g in report.graphs
    }
    one = ort.InferenceSession(str(export / "target.onnx"), providers=["CPUExecutionProvider"])
    cb = ort.InferenceSession(str(export / "target_cb.onnx"), providers=["CPUExecutionProvider"])
    kv = [i for i in one.get_inputs() if i.name.startswith("past_")]
    outs = [o.name for o in one.get_outputs() if not o.name.endswith("_RetainedState")]
    alone = [{i.name: np.zeros(i.shape, np.float32) for i in kv} for _ in range(args.slots)]
    full = {i.name: np.zeros([args.slots, *i.shape[1:]], np.float32) for i in kv}
    names = [o.name for o in cb.get_outputs()]
    P, B = info["prefill_seq_len"], info["block_size"]
    rng = np.random.default_rng(0)
    vocab = int(json.loads((export / "pair.json").read_text()).get("vocab_size", 1000))
    worst: dict[str, float] = {}
    seconds: dict[str, list[float]] = {}

    def run(sess, feeds, cache, kind, rows=None):
        index = {"batch_index": np.asarray(rows, np.int64)[:, None]} if rows is not None else {}
        t = time.perf_counter()
        res = dict(
            zip(
                names if rows is not None else [o.name for o in sess.get_outputs()],
                sess.run(None, {**feeds, **cache, **index}),
            )
        )
        seconds.setdefault(kind, []).append(time.perf_counter() - t)
        return res, {n: res[n + "_RetainedState"] for n in cache}

    def compare(mine, shared, r):
        for o in outs:
            a, b = mine[o], shared[o][r : r + 1]
            d = float(np.mean(a != b)) if np.issubdtype(a.dtype, np.integer) else float(np.max(np.abs(a - b)))
            worst[o] = max(worst.get(o, 0.0), d)

    lens = [P - 3 * k for k in range(args.slots)]  # each slot's prompt: one prefill chunk, padded with -1
    for slot, n in enumerate(lens):
        pos = np.where(np.arange(P) < n, np.arange(P), -1)[None]
        feeds = {"input_ids": rng.integers(0, vocab, (1, P)), "position_ids": pos}
        mine, alone[slot] = run(one, feeds, alone[slot], "prefill, one sequence")
        shared, full = run(cb, feeds, full, "prefill, slot graph", [slot])
        compare(mine, shared, 0)
    filled = list(lens)
    for width in (B, B, 1):
        feeds = {
            "input_ids": rng.integers(0, vocab, (args.slots, width)),
            "position_ids": np.stack([np.arange(f, f + width) for f in filled]),
        }
        shared, full = run(cb, feeds, full, f"{width} tokens x {args.slots} slots", list(range(args.slots)))
        for slot in range(args.slots):
            row = {k: v[slot : slot + 1] for k, v in feeds.items()}
            mine, alone[slot] = run(one, row, alone[slot], f"{width} tokens, one sequence")
            compare(mine, shared, slot)
        filled = [f + width for f in filled]
    cache_diff = max(float(np.max(np.abs(alone[s][n][0] - full[n][s]))) for s in range(args.slots) for n in full)
    doc |= {
        "max_diff": worst,
        "cache_max_diff": cache_diff,
        "median_s": {k: float(np.median(v)) for k, v in seconds.items()},
    }
    print(json.dumps(doc, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
