"""Plain greedy decode speed, dflash vs ONNX Runtime GenAI, interleaved on one checkpoint.

Runs in a benchmark venv that has both dflash and onnxruntime-genai (never a dflash dependency):

    bash benchmarks/peers_setup.sh                       # creates .bench-venv (dflash -e + onnxruntime-genai)
    .bench-venv/bin/python benchmarks/peers_decode.py --pair /work/pairs/qwen3-0.6b --work /work/peers

For each precision (fp32, int4) it builds the target once with GenAI's model builder and once with
`dflash build` (compile.ort.precision), then, REPS times in turn, decodes NEW tokens greedily from the
same prompt token ids (held-out standard-library text) with each engine: dflash plain with
allow_spinning off (the default, right for DFlash's two sessions) and on (plain's best), and GenAI.
Decode tok/s excludes the prompt and the first token. Reported: medians and ratios to GenAI per
precision, and the dflash-vs-GenAI token agreement (random weights: both are greedy on the same
weights; fp32 should agree, int4 quantisers differ).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def genai_model(pair: Path, work: Path, precision: str) -> Path:
    out = work / f"genai-{precision}"
    if not (out / "genai_config.json").is_file():
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(pair / "target"), "-o", str(out)]
        cmd += ["-p", precision, "-e", "cpu", "-c", str(work / "genai-cache")]
        subprocess.run(cmd, check=True)
    return out


def dflash_engine(pair: Path, work: Path, precision: str, spinning: bool):
    from dflash_cli.cache import Cache
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.pipeline import build
    from dflash_cli.recipe import load_recipe

    recipe = work / "recipe.yaml"
    family = json.loads((pair / "target" / "config.json").read_text())["model_type"]
    recipe.write_text(
        f"name: peers\nfamily: {family}\ntarget: {{path: {pair / 'target'}}}\ndraft: {{path: {pair / 'draft'}}}\n"
        "export: {ctx_len: 1024, prefill_seq_len: 128}\n"
    )
    sets = [f"compile.ort.precision={precision}", f"compile.ort.allow_spinning={str(spinning).lower()}"]
    r = load_recipe(str(recipe), sets)
    cache = Cache(work / "dflash-cache")
    build(r, cache)
    return Engine.load(r, cache)


def run_genai(model, prompt: list[int], new: int) -> tuple[list[int], float, float]:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompt)
    gen.generate_next_token()
    t1 = time.perf_counter()
    while not gen.is_done():
        gen.generate_next_token()
    t2 = time.perf_counter()
    tokens = list(gen.get_sequence(0))[len(prompt) :]
    return tokens, t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--precisions", default="fp32,int4")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import onnxruntime_genai as og

    from dflash_cli.readiness.fp16_bands import corpus_tokens

    args.work.mkdir(parents=True, exist_ok=True)
    engines: dict[str, tuple[str, object]] = {}
    for precision in args.precisions.split(","):
        engines[f"genai {precision}"] = ("genai", og.Model(str(genai_model(args.pair, args.work, precision))))
        for spinning in (False, True):
            e = dflash_engine(args.pair, args.work, precision, spinning)
            engines[f"dflash {precision} plain, spinning {'on' if spinning else 'off'}"] = ("dflash", e)
    first = next(e for kind, e in engines.values() if kind == "dflash")
    prompt = corpus_tokens(lambda text: list(first.tokenizer(text)["input_ids"]), args.prompt_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for name, (kind, e) in engines.items():
            if kind == "genai":
                tokens, _, decode_s = run_genai(e, prompt, args.new)
            else:
                g = e.generate(prompt, mode="plain", max_new_tokens=args.new)
                tokens, decode_s = g.tokens, g.decode_s
            outputs[name] = tokens
            if rep:
                rates[name].append((len(tokens) - 1) / decode_s)
        print(f"round {rep}/{args.reps} done", flush=True)
    doc = {
        "pair": str(args.pair),
        "prompt_tokens": len(prompt),
        "new_tokens": args.new,
        "reps": args.reps,
        "engines": {},
    }
    for name, r in rates.items():
        precision = name.split()[1]
        ref = statistics.median(rates[f"genai {precision}"])
        same = sum(a == b for a, b in zip(outputs[name], outputs[f"genai {precision}"]))
        doc["engines"][name] = {
            "decode_tok_s_median": statistics.median(r),
            "range": [min(r), max(r)],
            "vs_genai": statistics.median(r) / ref,
            "tokens_equal_to_genai": f"{same}/{len(outputs[name])}",
        }
        print(
            f"{name:40s} {statistics.median(r):7.2f} tok/s  [{min(r):.2f}, {max(r):.2f}]  "
            f"{statistics.median(r) / ref:.2f}x GenAI  tokens equal to GenAI {same}/{len(outputs[name])}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
