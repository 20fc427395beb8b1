"""fp16 emulation per position band, with the causes told apart: what `-convert-to-fp16` would do to our graphs.

For a pair built at ctx_len 4096 (the demo pair, or a tiny random Llama-3.1-style pair), judge one
or more exports (this checkout's, plus `--also LABEL=EXPORT_DIR` for exports made by older code)
three ways, each adding one hazard:
  clean    no padding rows, caches start at zero      -> RoPE at long positions, RMSNorm overflow
  padded   prefill chunks end in padding rows          -> + the mask value (fully masked rows)
  stale    padded, and fp16 caches start as NaN        -> + retained buffers nobody zeroed (a card)
and list the static hazards readiness.fp16_lint names in each graph.

    python benchmarks/fp16_bands.py demo --out benchmarks/results/fp16-bands
    python benchmarks/fp16_bands.py tiny-llama --work /tmp/tiny-llama --out benchmarks/results/fp16-bands
    python benchmarks/fp16_bands.py tiny-llama --work /tmp/tiny-llama --write-only   # pair + recipe only

The tiny Llama gets one "massive activation" channel (every token's embedding is OUTLIER there), as
real Llama / Qwen residual streams carry values of 1e3-1e4 in a few channels; random weights alone
stay far below fp16's limits and would hide the RMSNorm overflow.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures.tiny_pairs writes the tiny pair

CTX_LEN = 4096
PREFILL = 64
OUTLIER = 1000.0
OUTLIER_CHANNEL = 7
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
ABLATIONS = {"clean": (0, False), "padded": (None, False), "stale": (None, True)}


def write_tiny_llama(work: Path) -> Path:
    """Tiny random Llama-3.1-style target + z-lab-format draft under `work`; returns the recipe path."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.fixtures.tiny_pairs import write_dflash_draft, write_llama_target, write_recipe

    recipe = work / "recipe.yaml"
    if recipe.is_file():
        return recipe
    target = write_llama_target(
        work / "target", layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256,
        rope_parameters=LLAMA31_ROPE,
    )  # fmt: skip
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (target / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(str(target / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    embed[:, OUTLIER_CHANNEL] = torch.full_like(embed[:, OUTLIER_CHANNEL], OUTLIER)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    draft = write_dflash_draft(work / "draft", target, layers=2, block_size=8)
    return write_recipe(recipe, target, draft, "llama", export={"ctx_len": CTX_LEN, "prefill_seq_len": PREFILL})


def lint(export_dir: Path) -> dict[str, dict[str, int]]:
    import onnx

    from dflash_cli.readiness.fp16_lint import fp16_hazards

    out = {}
    for graph in ("target", "draft"):
        counts: dict[str, int] = {}
        for h in fp16_hazards(onnx.load(str(export_dir / f"{graph}.onnx"), load_external_data=False)):
            counts[h.kind] = counts.get(h.kind, 0) + 1
        out[graph] = counts
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair", choices=["demo", "tiny-llama"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/dflash-fp16-bands"), help="tiny pair + cache")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fp16-bands")
    ap.add_argument("--also", action="append", default=[], help="LABEL=EXPORT_DIR, an export to judge too")
    ap.add_argument("--write-only", action="store_true", help="write the tiny pair and its recipe, then stop")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()

    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.readiness.fp16_bands import corpus_tokens, fp16_bands
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    if args.pair == "demo":
        recipe = load_recipe("demo", [f"export.ctx_len={CTX_LEN}", f"export.prefill_seq_len={PREFILL}"])
        cache = Cache(None)
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        path = write_tiny_llama(args.work)
        print(f"recipe: {path}")
        if args.write_only:
            return
        recipe, cache = load_recipe(str(path)), Cache(args.work / "cache")
    built = build(recipe, cache)
    engine = Engine.load(recipe, cache)
    tokens = corpus_tokens(lambda text: list(engine.tokenizer(text)["input_ids"]), CTX_LEN)
    exports = {"this checkout": built.path("export")}
    exports |= {label: Path(d) for label, d in (a.split("=", 1) for a in args.also)}

    doc: dict = {
        "pair": args.pair,
        "ctx_len": CTX_LEN,
        "prefill_seq_len": PREFILL,
        "tokens": len(tokens),
        "exports": {},
    }
    for label, export_dir in exports.items():
        entry: dict = {"export_dir": str(export_dir), "hazards": lint(export_dir), "ablations": {}}
        for name, (pad, stale) in ABLATIONS.items():
            t0 = time.perf_counter()
            report = fp16_bands(
                engine, export_dir, tokens, max_new_tokens=args.max_new_tokens, padding_rows=pad, stale=stale,
                end_to_end=name == "stale",
            )  # fmt: skip
            entry["ablations"][name] = report.to_dict()
            print(f"[{label}] {name} ({time.perf_counter() - t0:.0f} s)\n{report.render_text()}", flush=True)
        doc["exports"][label] = entry

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{args.pair}-ctx{CTX_LEN}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(doc) + "\n")
    print(f"wrote {stem}.json and .md")


def markdown(doc: dict) -> str:
    lines = [
        f"# fp16 emulation by position band: {doc['pair']} pair, ctx_len {doc['ctx_len']}, "
        f"prefill chunks of {doc['prefill_seq_len']}",
        "",
        "argmax agreement (teacher-forced, fp16 vs fp32) / largest context-feature error (relative) / "
        "non-finite values in fp16 outputs; `stale` also runs greedy DFlash from prompts placed in each band "
        "(identical outputs / placements).",
        "",
    ]
    for label, entry in doc["exports"].items():
        hazards = "; ".join(f"{g}: {c or 'none'}" for g, c in entry["hazards"].items())
        lines += [f"## {label}", "", f"static hazards (fp16_lint): {hazards}", ""]
        bands = [b["band"] for b in entry["ablations"]["clean"]["bands"]]
        lines += ["| ablation | " + " | ".join(bands) + " | verdict |", "| --- |" + " --- |" * (len(bands) + 1)]
        for name, rep in entry["ablations"].items():
            cells = []
            for b in rep["bands"]:
                gen = f", gen {b['identical']}/{b['generations']}" if b["generations"] else ""
                err = b["max_feature_error"]
                err_s = "inf" if err == float("inf") else f"{err:.1e}"
                cells.append(f"{b['agreement']:.1%} / {err_s} / {b['nonfinite']}{gen}")
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {'PASS' if rep['ok'] else 'FAIL'} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
