"""Verify-cost curve, fp32 vs int8, and decode-loop overhead for a ~100M-parameter random target.

    .venv/bin/python benchmarks/verify_cost.py [--out benchmarks/results/verify_cost.json]
    .venv/bin/python benchmarks/verify_cost.py --recipe demo --out benchmarks/results/verify_cost_demo.json

Builds a random Qwen3 target (hidden 768, 12 layers, vocab 32768: ~101M parameters) and a
random 2-layer DFlash draft through the real pipeline, then measures with ONNX Runtime:
* median target-call time for 1, 2, 4, 8, 16 tokens (how verify cost grows with the block), fp32 and int8;
* the decode loop's overhead: wall time not spent inside ONNX Runtime calls, plain and DFlash.
Random weights accept nothing, so no speedup is claimed here; see `dflash bench` with the demo pair.
With --recipe, the same measurements run on that recipe's pair instead of the random one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_pair(root: Path, block: int) -> tuple[Path, Path]:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.fixtures.tiny_pairs import write_dflash_draft, write_tokenizer

    target = root / "target"
    write_tokenizer(target)
    cfg = Qwen3Config(
        vocab_size=32768,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(target))
    draft = write_dflash_draft(root / "draft", target, layers=2, block_size=block, target_layer_ids=[1, 5, 9])
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "verify_cost.json")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--recipe", help="measure this recipe's pair instead of a random ~100M target")
    args = ap.parse_args()

    import numpy as np
    import yaml

    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    with tempfile.TemporaryDirectory(prefix="dflash-verify-cost-") as tmp:
        tmp = Path(tmp)
        if args.recipe:
            recipe_path = args.recipe
            target = Path(load_recipe(args.recipe).target.path)
            cache = Cache()
        else:
            target, draft = write_pair(tmp, args.block_size)
            recipe_path = tmp / "bench.yaml"
            recipe_path.write_text(
                yaml.safe_dump(
                    {
                        "name": "random-100m",
                        "family": "qwen3",
                        "target": {"path": str(target)},
                        "draft": {"path": str(draft)},
                        "export": {"ctx_len": 1024, "prefill_seq_len": 64},
                    }
                )
            )
            cache = Cache(tmp / "cache")
        params = sum(np.prod(s) for s in _shapes(target / "model.safetensors"))
        report = {
            "target_params": int(params),
            "recipe": str(recipe_path) if args.recipe else "random-100m",
            "repeats": args.repeats,
        }
        engines = {}
        for precision in ("fp32", "int8"):
            recipe = load_recipe(str(recipe_path), [f"compile.ort.precision={precision}"])
            t = time.perf_counter()
            engines[precision] = build_engine(recipe, cache)
            report[f"build_s_{precision}"] = round(time.perf_counter() - t, 1)
        # Interleave precisions per size so machine noise hits both alike.
        curve = {"fp32": {}, "int8": {}}
        for n in (1, 2, 4, 8, 16):
            for precision, engine in engines.items():
                curve[precision][n] = engine.verify_cost_curve((n,), repeats=args.repeats)[n]
        report["step_seconds"] = {p: {str(n): c[n] for n in c} for p, c in curve.items()}
        report["relative_to_t1"] = {p: {str(n): c[n] / c[1] for n in c} for p, c in curve.items()}
        rng = np.random.default_rng(0)
        vocab = engines["fp32"].tokenizer.vocab_size if args.recipe else 32000
        prompts = [
            list(map(int, rng.integers(2, vocab, size=int(n)))) for n in rng.integers(16, 200, size=args.prompts)
        ]
        for precision, engine in engines.items():
            for mode in ("plain", "dflash"):
                runs = [engine.generate(p, mode=mode, max_new_tokens=args.new_tokens) for p in prompts]
                decode = sum(r.decode_s for r in runs)
                report.setdefault("loop", {}).setdefault(precision, {})[mode] = {
                    "decode_s": decode,
                    "inside_sessions_s": sum(r.target_s + r.draft_s for r in runs),
                    "overhead_fraction": sum(r.loop_overhead_s for r in runs) / decode,
                    "tpot_ms_median": 1000 * statistics.median(r.time_per_output_token for r in runs),
                }
        report["block_size"] = engines["fp32"].block_size
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"target parameters: {report['target_params'] / 1e6:.1f}M, block {report['block_size']}")
    print(f"{'tokens':>6} " + " ".join(f"{p + ' ms':>10} {p + ' x T1':>10}" for p in curve))
    for n in (1, 2, 4, 8, 16):
        print(f"{n:>6} " + " ".join(f"{curve[p][n] * 1000:>10.2f} {curve[p][n] / curve[p][1]:>10.2f}" for p in curve))
    for precision, modes in report["loop"].items():
        for mode, m in modes.items():
            print(
                f"loop overhead {precision} {mode}: {m['overhead_fraction']:.1%} of decode time "
                f"(TPOT median {m['tpot_ms_median']:.2f} ms)"
            )
    print(f"wrote {args.out}")


def _shapes(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            yield f.get_slice(k).get_shape()


if __name__ == "__main__":
    main()
