"""What a JSON schema costs decoding on the demo pair, in one bench run (issue 61).

    .venv/bin/python benchmarks/structured_bench.py --cache DIR [--prompts 20] [--new 96]
        [--out benchmarks/results/structured/demo-schema-bench.json]

The bench runner (`dflash bench`'s, every mode, lossless checked) over one dataset that holds each of N
HumanEval prompts twice, free and under a JSON schema (a function's summary: name, arguments, return type), so
both variants of a prompt run back to back. Per variant and mode: median decode tok/s and mean tau; the
schema's cost is the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.bench import BenchSettings, run_bench  # noqa: E402
from dflash_cli.bench.datasets import load_dataset  # noqa: E402
from dflash_cli.cache.store import Cache  # noqa: E402
from dflash_cli.decoding.engine import build_engine  # noqa: E402
from dflash_cli.recipe.schema import load_recipe  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
        "args": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_]{1,8}$"}, "maxItems": 3},
        "returns": {"enum": ["int", "str", "list", "bool", "None"]},
    },
    "required": ["name", "args", "returns"],
    "additionalProperties": False,
}
MODES = ("plain", "dflash", "lookup", "hybrid")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    texts = [s.turns[0] for s in load_dataset("humaneval", max_samples=args.prompts, seed=5)]
    rows = [
        r
        for i, t in enumerate(texts)
        for r in ({"id": f"free/{i}", "prompt": t}, {"id": f"schema/{i}", "prompt": t, "json_schema": SCHEMA})
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        samples = load_dataset(str(path))
        engine = build_engine(load_recipe("demo", ["export.logits=true"]), Cache(args.cache))
        settings = BenchSettings(dataset=str(path), max_new_tokens=args.new)
        result = run_bench(engine, samples, settings, modes=MODES)
    assert result.lossless_checked and not result.mismatches, "a constrained mode left constrained plain decoding"
    summary: dict = {"prompts": args.prompts, "new_tokens": args.new, "variants": {}}
    for variant in ("free", "schema"):
        records = [r for r in result.records if r.sample_id.startswith(variant + "/")]
        summary["variants"][variant] = {
            m: {
                "decode_tok_s_median": round(statistics.median(r.results[m].decode_tokens_per_s for r in records), 1),
                "tau_mean": round(statistics.mean(r.results[m].tau for r in records), 2),
                "new_tokens_mean": round(statistics.mean(r.results[m].new_tokens for r in records), 1),
            }
            for m in MODES
        }
    v = summary["variants"]
    summary["schema_over_free"] = {
        m: round(v["schema"][m]["decode_tok_s_median"] / v["free"][m]["decode_tok_s_median"], 3) for m in MODES
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
