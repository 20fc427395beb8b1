"""What a structured-output constraint costs (issue 61): the grammar's mask per token, and whole decoding.

    .venv/bin/python benchmarks/grammar_cost.py --cache DIR [--work DIR] [--prompts 10] [--new 96]
        [--out benchmarks/results/structured/grammar-cost.json]

1. Mask time per token with llguidance, on the demo's tokenizer (4,096 tokens) and on a byte-level BPE asked
   for 151,646 tokens (Qwen3's size; the standard library yields 122,698) trained here (cached under --work):
   grammar compile time, then per position along a valid document the time of `Constraint.masked` on a logits row (the
   bitmask, unpacked, applied) and of `advance`, for a JSON schema and a regex. Medians and 90th percentiles.
2. Whole decoding on the demo pair built with logits: HumanEval prompts decoded plain and DFlash with no
   constraint and with one that admits any text (regex `[\\s\\S]*`), interleaved per prompt, so the outputs are
   equal and the difference is the grammar's cost alone. Decode tok/s medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cli.decoding.constraint import ConstraintSpec, compile_constraint, llguidance_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}},
    },
    "required": ["name", "tags", "score", "nested"],
    "additionalProperties": False,
}
DOC = '{"name":"a parser for config files","tags":["io","text","json"],"score":0.875,"nested":{"ok":true,"n":42}}'
REGEX = (r"[A-Z][a-z]+ [0-9]{4}-[0-9]{2}-[0-9]{2}: [a-z ]+\.", "Release 2026-12-07: the grammar cost is measured.")


def big_tokenizer(work: Path, size: int = 151646):
    """A byte-level BPE of `size` tokens trained on the standard library (cached)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dflash_cli.corpora.stdlib import list_sources, read_text

    out = work / f"bpe-{size}"
    if not (out / "tokenizer.json").exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator((t for p in list_sources() if (t := read_text(p))), trainer=trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
        fast.save_pretrained(str(out))
    return PreTrainedTokenizerFast.from_pretrained(str(out))


def mask_costs(tokenizer, spec: ConstraintSpec, text: str, reps: int = 5) -> dict:
    vocab = len(tokenizer)
    lltok = llguidance_tokenizer(tokenizer, vocab, [tokenizer.eos_token_id])
    t = time.perf_counter()
    compile_constraint(spec, lltok)
    compile_ms = (time.perf_counter() - t) * 1e3
    tokens = tokenizer.encode(text, add_special_tokens=False)
    row = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    masked, advanced = [], []
    for _ in range(reps):
        grammar = compile_constraint(spec, lltok)
        for tok in tokens:
            t0 = time.perf_counter()
            grammar.masked(row)
            t1 = time.perf_counter()
            grammar.advance(tok)
            masked.append((t1 - t0) * 1e6)
            advanced.append((time.perf_counter() - t1) * 1e6)
    q = statistics.quantiles
    return {
        "vocab": vocab,
        "kind": spec.kind,
        "tokens": len(tokens),
        "compile_ms": round(compile_ms, 2),
        "mask_us_median": round(statistics.median(masked), 1),
        "mask_us_p90": round(q(masked, n=10)[-1], 1),
        "advance_us_median": round(statistics.median(advanced), 1),
    }


def decode_costs(cache: Path, prompts: int, new: int) -> dict:
    import random

    from dflash_cli.bench.datasets import load_dataset
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    recipe = load_recipe("demo", ["export.logits=true"])
    build(recipe, Cache(cache))
    engine = Engine.load(recipe, Cache(cache))
    samples = load_dataset("humaneval")
    texts = [samples[i].turns[0] for i in sorted(random.Random(0).sample(range(len(samples)), prompts))]
    anything = ConstraintSpec("regex", r"[\s\S]*")
    rates: dict[str, list[float]] = {}
    for text in texts:
        ids = engine.encode_prompt(text)
        for mode in ("plain", "dflash"):
            free = engine.generate(ids, mode=mode, max_new_tokens=new)
            held = engine.generate(ids, mode=mode, max_new_tokens=new, constraint=anything)
            assert held.tokens == free.tokens, "a grammar admitting any text changed the output"
            rates.setdefault(f"{mode}", []).append(free.decode_tokens_per_s)
            rates.setdefault(f"{mode}+grammar", []).append(held.decode_tokens_per_s)
    med = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    return {
        "tok_s_median": med,
        "ratio_with_grammar": {m: round(med[f"{m}+grammar"] / med[m], 3) for m in ("plain", "dflash")},
        "prompts": prompts,
        "new_tokens": new,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path(".grammar-work"))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import llguidance
    from transformers import AutoTokenizer

    demo = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[1] / "models" / "demo-target"))
    big = big_tokenizer(args.work)
    masks = [
        mask_costs(tok, spec, text)
        for tok in (demo, big)
        for spec, text in ((ConstraintSpec("json_schema", SCHEMA), DOC), (ConstraintSpec("regex", REGEX[0]), REGEX[1]))
    ]
    for m in masks:
        print(json.dumps(m))
    result = {
        "llguidance": llguidance.__version__,
        "masks": masks,
        "decode": decode_costs(args.cache, args.prompts, args.new),
    }
    print(json.dumps(result["decode"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
