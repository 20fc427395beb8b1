"""What the content check costs an engine's start: `Engine.load` of a built recipe with the check and
with it turned off, each in a fresh process (the check runs once per process), rounds interleaved.

    .venv/bin/python benchmarks/content_check_cost.py RECIPE.yaml --cache-dir CACHE [--set K=V] [--rounds 5] [--out F]

Prints the median load seconds of each, their ratio, the bytes hashed and the hashing rate. The page
cache is warm after the first round (as on a machine that runs the same pair again); round 0 is kept
out of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys, time
from dflash_cli.cache import contents as cache_contents
from dflash_cli.cache.store import Cache
from dflash_cli.decoding.engine import Engine
from dflash_cli.recipe.schema import load_recipe

recipe, cache, check, sets = sys.argv[1], sys.argv[2], sys.argv[3] == "on", sys.argv[4:]
made = []
real = cache_contents.ContentCheck

class Off:
    def __init__(self, *a, **k): self.bytes_hashed = 0
    def wait(self): pass

def counted(*a, **k):
    made.append(real(*a, **k))
    return made[-1]

cache_contents.ContentCheck = counted if check else Off
t0 = time.perf_counter()
engine = Engine.load(load_recipe(recipe, sets), Cache(cache))
loaded = time.perf_counter() - t0
t1 = time.perf_counter()
ids = engine.encode_prompt("def fibonacci(n):")
engine.generate(ids, max_new_tokens=1, mode="plain")
print(json.dumps({"load_s": loaded, "first_token_s": time.perf_counter() - t1,
                  "bytes_hashed": sum(m.bytes_hashed for m in made)}))
"""


def one(recipe: str, cache: str, check: str, sets: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, recipe, cache, check, *sets], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="KEY=VALUE, as the build had it")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(args.rounds + 1):
        for check in ("off", "on") if r % 2 else ("on", "off"):
            runs[check].append(one(args.recipe, args.cache_dir, check, args.sets))
            print(f"round {r} check {check}: {runs[check][-1]}", file=sys.stderr)
    med = {k: statistics.median(x["load_s"] for x in v[1:]) for k, v in runs.items()}
    hashed = max(x["bytes_hashed"] for x in runs["on"])
    doc = {
        "recipe": args.recipe,
        "rounds": args.rounds,
        "load_s_median": med,
        "ratio_on_off": med["on"] / med["off"],
        "added_s": med["on"] - med["off"],
        "bytes_hashed": hashed,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
