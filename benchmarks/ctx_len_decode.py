"""Decode speed of the same generations under several builds of the demo recipe, interleaved per prompt.

    python benchmarks/ctx_len_decode.py "CACHE_DIR" "CACHE_DIR:export.ctx_len=4096" [...]

Each argument is a cache dir and comma-separated --set overrides (built if missing). 16 HumanEval
prompts, 128 new tokens, plain and DFlash, three rounds (the first is warm-up); medians of decode
tok/s (prefill excluded).
"""

import statistics
import sys

from dflash_cli.bench.datasets import load_dataset
from dflash_cli.cache.store import Cache
from dflash_cli.decoding.engine import Engine
from dflash_cli.recipe.schema import load_recipe
from dflash_cli.stages.pipeline import build

variants = []
for arg in sys.argv[1:]:
    d, _, sets = arg.partition(":")
    variants.append((arg, load_recipe("demo", [s for s in sets.split(",") if s]), Cache(d)))
for _, r, c in variants:
    build(r, c)
engines = {name: Engine.load(r, c) for name, r, c in variants}
samples = load_dataset("humaneval", max_samples=16, seed=0)
e0 = next(iter(engines.values()))
prompts = [e0.encode_prompt(s.turns[0]) for s in samples]
res = {(n, m): [] for n in engines for m in ("plain", "dflash")}
for rep in range(3):
    for ids in prompts:
        for n, e in engines.items():
            for m in ("plain", "dflash"):
                g = e.generate(ids, mode=m, max_new_tokens=128)
                if rep:
                    res[(n, m)].append(g.decode_tokens / g.decode_s)
for (n, m), v in res.items():
    print(f"{n:50s} {m:7s} median decode tok/s {statistics.median(v):7.1f}")
