"""Per-call cost of compiled graphs, side by side: T(1), T(block) and the draft call, interleaved.

    python benchmarks/graph_step_cost.py LABEL=COMPILE_DIR[#prefix] [...] [--calls 200] [--start 100] [--out F.json]
        [--as-run] [--lengths 1,2,4,8,16]

Each COMPILE_DIR is a compile artifact (target.onnx, draft.onnx, export.json), from any revision of
this code, so graphs built by older checkouts can be timed against today's in one process. Every
round times one call of each kind on every variant in turn (so machine noise hits all alike), at
cache positions 100.. as in a short generation; medians and ratios to the first variant are reported.
Decode-relevant only: prefill is one call per prompt. `--as-run`: the sessions as `dflash run` opens
them for plain decoding (one spinning thread pool shared by all; one-token target calls padded to two
rows only where the build said so) and the variants' order rotating each round; also reports whether
each variant's target outputs equal the first variant's. `--lengths`: target calls of these lengths
too (the verify-cost curve T(B) / T(1); a mixture-of-experts target reads more experts as B grows).
`--draft-rows`: draft calls of these many rows too (graph revision 12 on: a DFlash draft's prefix graph drafts
any number of rows), and the break-even tau (T_draft(D) + T(D)) / T(1) of drafting and verifying D rows.
`--head-rows`: for each length D of `--lengths`, a draft call of the whole block that asks for only D-1 proposals
(graph revision 15 on: `proposal_rows`, so the others skip the vocabulary head; the proposals do not change), and
the break-even tau (T_draft(head D-1) + T(D)) / T(1) of verifying D tokens that way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START = 100  # cache position of the first timed call


def open_variant(spec: str, as_run: bool = False):
    """COMPILE_DIR, or COMPILE_DIR#prefix for its prefix-cache graphs (graph revision 7 on)."""
    from dflash_cli.backends.ort import OrtSession
    from dflash_cli.backends.ort_prefix import open_prefix_session

    where, _, flavour = spec.partition("#")
    path = Path(where)
    info = json.loads((path / "export.json").read_text())
    if flavour == "prefix":
        g = info["graphs"]
        # in-place KV (GroupQueryAttention) where the compile stage rewrote the target (compile revision 4 on)
        target = open_prefix_session(path / g["target_prefix"]["onnx"], "target", info["ctx_len"])
        draft = open_prefix_session(path / g["draft_prefix"]["onnx"], "draft", info["ctx_len"])
        if as_run:  # as the engine decides (decoding/engine.py)
            facts = json.loads((path / "compile.json").read_text())
            target.pad_single_rows = facts.get("prefix_one_token_calls") != "one row"
    else:
        target = OrtSession(path / info["graphs"]["target"]["onnx"], "target")
        draft = OrtSession(path / info["graphs"]["draft"]["onnx"], "draft")
    hidden = draft._sess.get_inputs()[2].shape[-1]
    return info, target, draft, hidden


def timed(session, feeds: dict, outputs: dict | None = None) -> float:
    t = time.perf_counter()
    got = session.run(feeds)
    seconds = time.perf_counter() - t
    if outputs is not None:
        outputs.update({k: np.array(v, copy=True) for k, v in got.items()})  # not a view of a reused buffer
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="LABEL=COMPILE_DIR")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--start", type=int, default=START, help="cache position of the first timed call")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--as-run", action="store_true", help="shared spinning pool, padding as built, rotating order")
    ap.add_argument("--lengths", default="", help="comma-separated target call lengths to time as well")
    ap.add_argument("--draft-rows", default="", help="comma-separated draft block lengths to time as well")
    ap.add_argument("--head-rows", action="store_true", help="whole-block drafts asking for D-1 proposals")
    args = ap.parse_args()
    from dflash_cli.backends.base import proposal_rows
    from dflash_cli.exporting.names import PROPOSAL_ROWS

    if args.as_run:
        from dflash_cli.host.ort_threads import use_shared_thread_pool

        use_shared_thread_pool(0)
    variants = {}
    for v in args.variants:
        label, _, path = v.rpartition("=")
        variants[label] = open_variant(path, args.as_run)
    block = {info["block_size"] for info, *_ in variants.values()}
    assert len(block) == 1, "variants must share the block size"
    B = block.pop()
    rng = np.random.default_rng(0)
    lengths = sorted({1, B, *(int(n) for n in args.lengths.split(",") if n)})
    rows = sorted({int(n) for n in args.draft_rows.split(",") if n} - {B})
    heads = [n for n in lengths if 1 < n < B] if args.head_rows else []
    keys = [f"T({n})" for n in lengths] + ["draft"] + [f"draft({n})" for n in rows] + [f"head({n})" for n in heads]
    times: dict[str, dict[str, list[float]]] = {label: {k: [] for k in keys} for label in variants}
    for info, target, draft, _ in variants.values():  # fill the cache up to START, untimed
        target.reset()
        draft.reset()
        P = info["prefill_seq_len"]
        for s in range(0, args.start, P):
            n = min(P, args.start - s)
            pos = np.full((1, P), -1, np.int64)
            pos[0, :n] = np.arange(s, s + n)
            target.run({"input_ids": np.ones((1, P), np.int64), "position_ids": pos})
    first = next(iter(variants))
    same = dict.fromkeys(variants, True)
    for i in range(args.calls):
        p = args.start + (i % 64)  # stay within the first positions; rewriting slots is what decoding does
        one = {"input_ids": rng.integers(1, 100, (1, 1)), "position_ids": np.array([[p]])}
        blk = {"input_ids": rng.integers(1, 100, (1, B)), "position_ids": np.arange(p, p + B)[None]}
        order = list(variants)
        if args.as_run:  # no variant always runs right after another's call
            order = order[i % len(order) :] + order[: i % len(order)]
        seen = {}
        for label in order:
            _, target, draft, hidden = variants[label]
            ctx = {
                "input_ids": rng.integers(1, 100, (1, B)),
                "position_ids": np.arange(p, p + B)[None],
                "context_features": rng.standard_normal((1, B, hidden)).astype(np.float32),
                "context_position_ids": np.arange(p - B, p)[None],
            }
            seen[label] = {}
            times[label]["T(1)"].append(timed(target, one, seen[label]))
            times[label][f"T({B})"].append(timed(target, blk))
            for n in lengths:
                if n not in (1, B):
                    call = {"input_ids": rng.integers(1, 100, (1, n)), "position_ids": np.arange(p, p + n)[None]}
                    times[label][f"T({n})"].append(timed(target, call))
            times[label]["draft"].append(timed(draft, ctx))
            for n in rows:  # the same context, a shorter block
                short = {**ctx, "input_ids": ctx["input_ids"][:, :n], "position_ids": ctx["position_ids"][:, :n]}
                times[label][f"draft({n})"].append(timed(draft, short))
            for n in heads:  # the same block, n - 1 proposals through the head
                times[label][f"head({n})"].append(timed(draft, {**ctx, PROPOSAL_ROWS: proposal_rows(n - 1)}))
        for label in variants:
            same[label] &= all(np.array_equal(seen[label][k], seen[first][k]) for k in seen[first])
    doc = {"calls": args.calls, "start": args.start, "block_size": B, "lengths": lengths, "variants": {}}
    print(f"{'variant':40s} {'T(1) ms':>9s} {f'T({B}) ms':>9s} {'draft ms':>9s}  T({B})/T(1) draft/T(1)  vs {first}")
    for label, t in times.items():
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        ratio = {k: med[k] / (statistics.median(times[first][k]) * 1e3) for k in med}
        per_one = {k: med[k] / med["T(1)"] for k in med if k.startswith("T(")}
        break_even = {
            n: (med.get(f"draft({n})", med["draft"] if n == B else None), med.get(f"T({n})")) for n in [*rows, B]
        }
        doc["variants"][label] = {
            "median_ms": med,
            "break_even_tau": {n: round((d + t) / med["T(1)"], 3) for n, (d, t) in break_even.items() if d and t},
            "break_even_tau_head": {n: round((med[f"head({n})"] + med[f"T({n})"]) / med["T(1)"], 3) for n in heads},
            "ratio_to_T1": per_one,
            "ratio_to_first": ratio,
            "outputs_equal_first": same[label],
        }
        print(
            f"{label:40s} {med['T(1)']:9.3f} {med[f'T({B})']:9.3f} {med['draft']:9.3f}  "
            f"{med[f'T({B})'] / med['T(1)']:10.2f} {med['draft'] / med['T(1)']:10.2f}  "
            + " ".join(f"{k} {r:.3f}x" for k, r in ratio.items())
            + ("" if same[label] else "  (outputs differ)")
        )
    if len(lengths) > 2:
        for label in variants:
            curve = doc["variants"][label]["ratio_to_T1"]
            print(f"{label:40s} T(B)/T(1): " + "  ".join(f"{k} {v:.2f}" for k, v in curve.items()))
    for label in variants:
        if rows:
            even = doc["variants"][label]["break_even_tau"]
            drafts = "  ".join(f"draft({n}) {doc['variants'][label]['median_ms'][f'draft({n})']:.1f}" for n in rows)
            print(
                f"{label:40s} {drafts}  break-even tau by rows: " + "  ".join(f"{n}: {v:.2f}" for n, v in even.items())
            )
        if heads:
            even = doc["variants"][label]["break_even_tau_head"]
            drafts = "  ".join(f"head({n}) {doc['variants'][label]['median_ms'][f'head({n})']:.1f}" for n in heads)
            tail = "  ".join(f"{n}: {v:.2f}" for n, v in even.items())
            print(f"{label:40s} {drafts}  break-even tau, D-1 proposals: {tail}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
