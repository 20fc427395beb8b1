"""Qwen3.5 / 3.6 exactness: tiny random pairs built at each precision and checked on what lossless needs.

For each pair (Qwen3.5 in the published multimodal layout and the text-only one, and a pair with
Qwen3.6-27B's head ratios) and precision (the build's defaults: int8 activations at int8 / int4):

* call-length invariance: a prefix, then one call of n tokens for every n from 1 to the longest verify
  (LOOKUP_BLOCKS blocks), against the same tokens one call each; the largest difference per output;
* greedy DFlash, lookup and hybrid against plain on --prompts prompts (tests/engines.mixed_prompts), tokens
  and logprobs (top 2) compared for equality, plus near ties: --search prompts decoded plainly, those with a
  position whose top-2 logits are within 1e-4 checked in every mode as well;
* at fp32, plain against Hugging Face's `generate`.

    .venv/bin/python benchmarks/qwen3_5_exactness.py --out benchmarks/results/qwen3_5/exactness-tiny.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_cli.exporting.options import LOOKUP_BLOCKS  # noqa: E402
from tests.engines import build_recipe, mixed_prompts  # noqa: E402
from tests.fixtures.tiny_pairs import make_pair  # noqa: E402

MODES = ("dflash", "lookup", "hybrid")
NEAR_TIE = 1e-4


def lengths_check(sess, vocab: int, block: int, room: int, seed: int = 3) -> dict:
    """Largest difference per output between calls of every length 1..longest and one-token calls."""
    longest = min(LOOKUP_BLOCKS * block, room - block - 2)
    ids = np.random.default_rng(seed).integers(0, vocab, size=(1, block + longest), dtype=np.int64)

    def call(start: int, n: int) -> dict:
        return sess.run({"input_ids": ids[:, start : start + n], "position_ids": np.arange(start, start + n)[None]})

    sess.reset()
    call(0, block)
    rows = [call(block + i, 1) for i in range(longest)]
    worst: dict[str, float] = {}
    for n in range(1, longest + 1):
        sess.reset()
        call(0, block)
        out = call(block, n)
        for name, a in out.items():
            b = np.concatenate([r[name] for r in rows[:n]], axis=1)
            diff = float(np.mean(a != b)) if a.dtype.kind in "iu" else float(np.abs(a - b).max())
            worst[name] = max(worst.get(name, 0.0), diff)
    sess.reset()
    return {"lengths": [1, longest], "max_diff": worst}


def min_gap(result) -> float:
    """Smallest top-1 minus top-2 logprob (= logit) gap over the committed tokens."""
    return min(t.top[0][1] - t.top[1][1] for t in result.logprobs)


def modes_check(engine, prompts: list[list[int]], new: int) -> dict:
    """Tokens and logprobs of every mode against plain's; near-tie positions counted (and so checked)."""
    mismatches, ties, gaps = [], 0, []
    for i, prompt in enumerate(prompts):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=new, logprobs=2)
        gaps.append(min_gap(plain))
        ties += sum(t.top[0][1] - t.top[1][1] < NEAR_TIE for t in plain.logprobs)
        for mode in MODES:
            got = engine.generate(prompt, mode=mode, max_new_tokens=new, logprobs=2)
            if got.tokens != plain.tokens or got.logprobs != plain.logprobs:
                mismatches.append({"prompt": i, "mode": mode})
    return {"prompts": len(prompts), "new_tokens": new, "mismatches": mismatches, "near_tie_positions": ties,
            "smallest_gap": min(gaps)}  # fmt: skip


def near_tie_prompts(engine, vocab: int, search: int, new: int, seed: int = 11) -> list[list[int]]:
    """Random prompts whose plain decoding meets a top-2 gap under NEAR_TIE."""
    rng = np.random.default_rng(seed)
    found = []
    for _ in range(search):
        prompt = rng.integers(2, vocab, size=int(rng.integers(1, 40))).tolist()
        if min_gap(engine.generate(prompt, mode="plain", max_new_tokens=new, logprobs=2)) < NEAR_TIE:
            found.append(prompt)
    return found


def hf_check(pair, engine, prompts: list[list[int]], new: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), dtype=torch.float32).eval()
    differ = 0
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                              pad_token_id=0)  # fmt: skip
        want = out[0, len(prompt) :].tolist()
        got = engine.generate(prompt, mode="plain", max_new_tokens=new).tokens
        differ += got != want[: len(got)]
    return {"prompts": len(prompts), "differ": differ}


def one_build(family: str, precision: str, work: Path, args) -> dict:
    from dflash_cli.decoding.engine import Engine

    root = work / f"{family}-{precision}"
    shutil.rmtree(root, ignore_errors=True)
    pair = make_pair(root / "pair", family)
    ort = {} if precision == "fp32" else {"ort": {"precision": precision}}
    t0 = time.perf_counter()
    recipe, cache = build_recipe(pair, root, export={"logits": True}, compile=ort)
    built_s = time.perf_counter() - t0
    engine = Engine.load(recipe, cache)
    facts = json.loads(next((root / "cache" / "artifacts" / "compile").glob("*/compile.json")).read_text())
    vocab, block = engine.tokenizer.vocab_size, engine.block_size
    entry = {
        "build_s": round(built_s, 1),
        "accuracy_level": facts.get("accuracy_level"),
        "build_check": facts.get("prefix_call_length_max_diff"),
        "call_lengths": lengths_check(engine.target, vocab, block, engine.ctx_len),
    }
    prompts = mixed_prompts(vocab, args.prompts)
    ties = near_tie_prompts(engine, vocab, args.search, args.new)
    entry["modes"] = modes_check(engine, prompts, args.new)
    entry["near_tie_prompts"] = {"searched": args.search, **modes_check(engine, ties, args.new)} if ties else {}
    if precision == "fp32":
        entry["hf_generate"] = hf_check(pair, engine, prompts, args.new)
    engine.release_artifacts()
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="qwen3_5,qwen3_5_text,qwen3_6")
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--search", type=int, default=300, help="random prompts searched for near ties")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    doc = {"args": vars(args) | {"out": str(args.out)}, "builds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            for precision in args.precisions.split(","):
                entry = one_build(family, precision, Path(tmp), args)
                doc["builds"][f"{family} {precision}"] = entry
                print(f"{family} {precision}: {json.dumps(entry)}", flush=True)
                if args.out:  # after every build: what is done stays written
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
