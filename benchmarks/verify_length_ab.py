"""DFlash with the whole block verified every step against verify lengths chosen by the draft's confidence.

    python benchmarks/verify_length_ab.py --recipe demo [--samples 164] [--tokens 128] [--set K=V ...] [--out F.json]
        [--emulate STEP_COST.json --emulate-t1-ms 5]

One engine; per HumanEval prompt, plain, DFlash `run.verify=block` and DFlash `run.verify=auto` back to back
(the order rotating with the prompt, so drift hits all alike). Greedy: every DFlash run must equal plain token
for token (counted, and the script exits 1 on any mismatch). Reports per mode tau (tokens per verify), mean
verify length, target seconds per step, total decode tokens/s, and the per-prompt geometric-mean speedup of
`auto` over `block` with its 95% interval. The calibration and cost fit carry over from prompt to prompt, as
on a server.

`--emulate`: every call is padded with a sleep to the cost that a `graph_step_cost.py --lengths ... --draft-rows
...` JSON measured for that many rows, scaled so that a one-token target call takes --emulate-t1-ms
(emulated_costs.py): the pair's own acceptance under another model's cost curve (e.g. the demo pair's drafts at
the 4B shape's int4 costs, whose acceptance a random pair cannot show).

`--modes plain,auto,auto-all`: `auto-all` is `auto` with every proposal of the block through the draft's head (as
before graph revision 15), the A/B of asking the draft only for the proposals a verify may use.
`--modes plain,hybrid,hybrid-nofloor`: the hybrid mode, and the hybrid charging time at its own recent rate even where
that is below what its cheapest step earns (before session 27); each learns its own statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("plain", "block", "auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--samples", type=int, default=164)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--emulate", type=Path, help="graph_step_cost.py JSON whose cost curve every call is padded to")
    ap.add_argument("--emulate-t1-ms", type=float, default=5.0)
    ap.add_argument("--modes", default=",".join(MODES), help="plain first; block, auto, auto-all, hybrid(-nofloor)")
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    assert modes[0] == "plain", "plain comes first: every mode is compared with it"

    from dflash_cli.bench.datasets import load_dataset
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.decoding.hybrid import HybridProposer
    from dflash_cli.decoding.verify_length import VerifyBudget
    from dflash_cli.recipe.schema import load_recipe

    every_proposal, no_floor = {"on": False}, {"on": False}
    floor = HybridProposer._rate_floor
    HybridProposer._rate_floor = lambda self, line: 0.0 if no_floor["on"] else floor(self, line)
    asked = VerifyBudget.proposal_rows
    VerifyBudget.proposal_rows = lambda self, most: most if every_proposal["on"] else asked(self, most)

    if args.emulate:
        from emulated_costs import install

        install(json.loads(args.emulate.read_text()), args.emulate_t1_ms)
    recipe = load_recipe(args.recipe, args.overrides)
    engine = build_engine(recipe, Cache())
    verify = {"auto-all": "auto", "hybrid": "auto", "hybrid-nofloor": "auto"}
    variants = {
        v: recipe.model_copy(update={"run": recipe.run.model_copy(update={"verify": verify.get(v, v)})})
        for v in modes[1:]
    }
    samples = load_dataset("humaneval", max_samples=args.samples)
    rows, mismatches, learnt = [], 0, {}
    for k, sample in enumerate(samples):
        ids = engine.encode_prompt(sample.turns[0])
        order = modes[k % len(modes) :] + modes[: k % len(modes)]
        row = {}
        for mode in order:
            if mode != "plain":
                engine.settings = dataclasses.replace(engine.settings, verify=variants[mode].run.verify)
            every_proposal["on"], no_floor["on"] = mode == "auto-all", mode == "hybrid-nofloor"
            run_mode = mode if mode == "plain" else "hybrid" if mode.startswith("hybrid") else "dflash"
            engine.learnt.hybrid_stats = learnt.get(mode)  # each hybrid variant learns its own statistics
            r = engine.generate(ids, mode=run_mode, max_new_tokens=args.tokens)
            learnt[mode] = engine.learnt.hybrid_stats
            row[mode] = r
        for mode in modes[1:]:
            if row[mode].tokens != row["plain"].tokens:
                mismatches += 1
        rows.append(row)
        if (k + 1) % 20 == 0:
            print(f"{k + 1}/{len(samples)} prompts", flush=True)

    report = {"recipe": args.recipe, "overrides": args.overrides, "samples": len(rows), "mismatches": mismatches}
    for mode in modes:
        rs = [row[mode] for row in rows]
        tokens = sum(len(r.tokens) for r in rs)
        steps = sum(len(r.accept_lengths) for r in rs) or 1
        report[mode] = {
            "decode_tokens_per_s": round(tokens / sum(r.decode_s for r in rs), 1),
            "tau": round(sum(sum(r.accept_lengths) for r in rs) / steps, 3),
            "mean_verify_length": round(sum(sum(r.verify_lengths) for r in rs) / steps, 2),
            "target_ms_per_step": round(1000 * sum(r.target_s for r in rs) / steps, 3),
            "draft_ms_per_call": round(1000 * sum(r.draft_s for r in rs) / max(1, sum(r.draft_calls for r in rs)), 3),
        }
    pairs = (("auto", "block"), ("auto", "auto-all"), ("auto", "plain"), ("block", "plain"), ("auto-all", "plain"))
    pairs += (("hybrid", "hybrid-nofloor"), ("hybrid", "plain"), ("hybrid-nofloor", "plain"))
    for a, b in (p for p in pairs if p[0] in modes and p[1] in modes):
        logs = [math.log(row[b].decode_s / row[a].decode_s) for row in rows if row[a].decode_s > 0]
        mean, se = statistics.mean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
        report[f"{a}_over_{b}"] = {
            "total": round(report[a]["decode_tokens_per_s"] / report[b]["decode_tokens_per_s"], 3),
            "geomean": round(math.exp(mean), 3),
            "ci95": [round(math.exp(mean - 1.96 * se), 3), round(math.exp(mean + 1.96 * se), 3)],
        }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(1 if mismatches else 0)


if __name__ == "__main__":
    main()
