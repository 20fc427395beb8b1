"""Plain decode speed of one pair at several int8/int4 quantisation block sizes, interleaved.

    python benchmarks/quant_block_decode.py RECIPE --cache DIR --precision int4 --blocks 32,64,128

Builds (or reuses) the compile stage once per `compile.ort.block_size`, all with spinning threads
(plain decoding's best), then decodes the same ~100-token prompt (held-out standard-library text)
REPS+1 times per engine in turn; the first round warms up. Prints the median decode tok/s per block.
Larger blocks mean fewer scales to apply per weight (faster) and coarser quantisation (less accurate).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from dflash_cli.cache.store import Cache
from dflash_cli.decoding.engine import Engine
from dflash_cli.readiness.fp16_bands import corpus_tokens
from dflash_cli.recipe.schema import load_recipe
from dflash_cli.stages.pipeline import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe")
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--precision", default="int4", choices=["int4", "int8"])
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    engines = {}
    for block in (int(b) for b in args.blocks.split(",")):
        sets = [f"compile.ort.precision={args.precision}", f"compile.ort.block_size={block}"]
        recipe = load_recipe(args.recipe, [*sets, "compile.ort.allow_spinning=true"])
        cache = Cache(args.cache)
        build(recipe, cache)
        engines[block] = Engine.load(recipe, cache)
    first = next(iter(engines.values()))
    prompt = corpus_tokens(lambda text: list(first.tokenizer(text)["input_ids"]), 100)
    rates: dict[int, list[float]] = {b: [] for b in engines}
    for rep in range(args.reps + 1):
        for block, engine in engines.items():
            g = engine.generate(prompt, mode="plain", max_new_tokens=args.new)
            if rep:
                rates[block].append((len(g.tokens) - 1) / g.decode_s)
    base = statistics.median(rates[next(iter(rates))])
    for block, r in rates.items():
        m = statistics.median(r)
        print(f"{args.precision} block {block:4d}: {m:6.2f} tok/s [{min(r):.2f}, {max(r):.2f}]  {m / base:.2f}x")


if __name__ == "__main__":
    main()
