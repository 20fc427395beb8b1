"""Benchmark: image prompts on a built vision-language pair: vision-tower time, TTFT, identical tokens.

For each image size, a random RGB image goes through the target's own image processor and our vision
graph (timed per call), then the prompt is decoded in plain and DFlash modes (TTFT = the prompt's
prefill, vision not included) and the tokens compared. Peak RSS of the process at the end.

    python benchmarks/vl_image_run.py /work/scale/qwen3-vl-8b/recipe.yaml /work/scale/qwen3-vl-8b/cache \
        --set compile.ort.precision=int4 --sizes 448x448 1024x768 --out benchmarks/results/vl/qwen3-vl-8b-int4.json
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("cache")
    ap.add_argument("--sizes", nargs="+", default=["448x448", "1024x768"], help="WIDTHxHEIGHT")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt", default="Describe this image.")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--set", action="append", default=[], dest="sets", help="as the build had it (KEY=VALUE)")
    args = ap.parse_args()

    from PIL import Image

    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.recipe.schema import load_recipe

    engine = Engine.load(load_recipe(args.recipe, args.sets), Cache(Path(args.cache)))
    reader = engine.images
    tower_calls: list[float] = []
    run_tower = reader._run_tower

    def timed_tower(feeds):
        t0 = time.perf_counter()
        out = run_tower(feeds)
        tower_calls.append(time.perf_counter() - t0)
        return out

    reader._run_tower = timed_tower
    rng = np.random.default_rng(0)
    rows = []
    for size in args.sizes:
        w, h = map(int, size.split("x"))
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        tower_calls.clear()
        t0 = time.perf_counter()
        ids, images = engine.encode_with_images(args.prompt, [image])
        encode_s = time.perf_counter() - t0
        runs = {}
        for mode in ("plain", "dflash"):
            r = engine.generate(ids, mode=mode, max_new_tokens=args.new_tokens, images=images)
            runs[mode] = {
                "tokens": r.tokens,
                "ttft_s": round(r.prefill_s, 3),
                "decode_tokens_per_s": round(r.decode_tokens_per_s, 3),
                "tau": r.tau,
            }
        row = {
            "image": size,
            "prompt_tokens": len(ids),
            "image_tokens": int(images.mask.sum()),
            "vision_tower_s": round(sum(tower_calls), 3),
            "encode_s (processor + tower + positions)": round(encode_s, 3),
            "runs": runs,
            "identical_tokens": runs["plain"]["tokens"] == runs["dflash"]["tokens"],
        }
        rows.append(row)
        print(
            f"{size}: {row['image_tokens']} image tokens, tower {row['vision_tower_s']} s, "
            f"TTFT plain {runs['plain']['ttft_s']} s, identical {row['identical_tokens']}"
        )
    doc = {
        "recipe": args.recipe,
        "rows": rows,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}))


if __name__ == "__main__":
    main()
