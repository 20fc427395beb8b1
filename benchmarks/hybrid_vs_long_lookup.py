"""Is the hybrid's gain only a longer verify? Prompt lookup with a fixed verify of 8, 16 or 32 tokens vs the
hybrid (lengths chosen per step), on one engine, every prompt in every mode back to back, order rotating.

The hybrid may verify up to LOOKUP_BLOCKS blocks where the target takes calls of any length; prompt lookup
in `dflash bench` verifies one block. This runs lookup at fixed longer lengths through the same loop, so
the comparison says what choosing the length per step adds over simply verifying more.

    python benchmarks/hybrid_vs_long_lookup.py --recipe demo --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dflash_cli.bench.conversation import encode_turn
from dflash_cli.bench.datasets import load_dataset
from dflash_cli.cache.store import Cache
from dflash_cli.decoding.engine import build_engine
from dflash_cli.decoding.loops import LookupProposer, LoopConfig, generate_speculative
from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter
from dflash_cli.decoding.target_calls import TimedSession
from dflash_cli.recipe.schema import load_recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--lengths", default="8,16,32", help="fixed verify lengths for prompt lookup")
    ap.add_argument("--out", help="write the per-mode totals as JSON here")
    args = ap.parse_args()
    engine = build_engine(load_recipe(args.recipe), Cache())
    samples = load_dataset(args.dataset)
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = LoopConfig(args.max_new_tokens, frozenset(engine.eos_token_ids))
    modes = [f"lookup-{n}" for n in lengths] + ["hybrid"]
    decode_s = {m: [] for m in modes}
    tokens = {m: 0 for m in modes}
    steps = {m: 0 for m in modes}
    for i, sample in enumerate(samples):
        prompt = encode_turn(engine, [], sample.turns[0])
        outputs = {}
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            if mode == "hybrid":
                res = engine.generate(prompt, mode="hybrid", max_new_tokens=args.max_new_tokens)
            else:
                n = int(mode.split("-")[1])
                engine.target.reset()
                proposer = LookupProposer(PromptLookupDrafter(n))
                res = generate_speculative(TimedSession(engine.target), proposer, prompt, engine.prefill_len, n, cfg)
            outputs[mode] = res.tokens
            decode_s[mode].append(res.decode_s)
            tokens[mode] += sum(res.accept_lengths)
            steps[mode] += len(res.accept_lengths)
        if len({tuple(t) for t in outputs.values()}) != 1:
            raise SystemExit(f"{sample.id}: the modes' outputs differ (lossless broken)")
    report = {}
    for mode in modes:
        ratios = [a / b for a, b in zip(decode_s[mode], decode_s["hybrid"])]
        report[mode] = {
            "decode_s": sum(decode_s[mode]),
            "tau": tokens[mode] / steps[mode],
            "time_vs_hybrid_total": sum(decode_s[mode]) / sum(decode_s["hybrid"]),
            "time_vs_hybrid_median_per_prompt": statistics.median(ratios),
        }
        r = report[mode]
        print(
            f"{mode:10s} decode {r['decode_s']:.2f} s  tau {r['tau']:.2f}  time / hybrid's: total "
            f"{r['time_vs_hybrid_total']:.3f}, median per prompt {r['time_vs_hybrid_median_per_prompt']:.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "modes": report}, f, indent=2)


if __name__ == "__main__":
    main()
