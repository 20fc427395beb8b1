"""Build tiny pairs through the real pipeline (convert -> compile) and open them as engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fixtures.tiny_pairs import TinyPair


def build_recipe(pair: TinyPair, root: Path, **overrides: Any):
    from dflash_cli.cache.store import Cache
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    path = pair.write_recipe(root / "recipe.yaml", **overrides)
    recipe = load_recipe(str(path))
    cache = Cache(root / "cache")
    build(recipe, cache)
    return recipe, cache


def open_engine(pair: TinyPair, root: Path, **overrides: Any):
    from dflash_cli.decoding.engine import Engine

    recipe, cache = build_recipe(pair, root, **overrides)
    return Engine.load(recipe, cache)


def mixed_prompts(vocab: int, n: int = 32, seed: int = 7) -> list[list[int]]:
    """Prompts of 1 to 45 tokens (every residue of a tiny pair's prefill chunk, 8, and block, 4); every other
    one repeats a short motif, so lookup and the hybrid propose long runs."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        length = 1 + (i * 13) % 45
        if i % 2:
            motif = rng.integers(2, vocab, size=1 + i % 5).tolist()
            prompts.append((motif * length)[:length])
        else:
            prompts.append(rng.integers(2, vocab, size=length).tolist())
    return prompts


def assert_every_mode_equals_hf(engines: dict, hf, prompts: list[list[int]], new_tokens: int, modes) -> None:
    """Greedy output of every engine ({form: Engine}) in every mode == Hugging Face's `generate`, token for token."""
    import torch

    stops = set(next(iter(engines.values())).eos_token_ids)
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        want = out[0, len(prompt) :].tolist()
        for form, engine in engines.items():
            for mode in modes:
                got = engine.generate(prompt, mode=mode, max_new_tokens=new_tokens).tokens
                assert got == want[: len(got)], f"{form} {mode}, prompt of {len(prompt)} tokens"
                assert len(got) == new_tokens or got[-1] in stops, f"{form} {mode} stopped early"


def dflash_ok(*args: str):
    """`dflash ARGS` through the CLI in process; fails the test on a non-zero exit."""
    from typer.testing import CliRunner

    from dflash_cli.cli.app import create_app

    result = CliRunner().invoke(create_app(), list(args))
    assert result.exit_code == 0, result.output
    return result


def assert_quantised_runs_agree(common: list[str], prompts_file: Path) -> dict:
    """`run --json` in every mode gives the same tokens; `bench` over `prompts_file` finds no mismatch.
    Returns the bench document."""
    import json

    runs = {}
    for mode in ("plain", "dflash", "lookup", "hybrid"):
        out = dflash_ok("run", *common, "--prompt", "def add(a, b):\n    return a + b\n" * 3, "--mode", mode,
                        "--max-new-tokens", "24", "--json")  # fmt: skip
        runs[mode] = json.loads(out.stdout)["token_ids"]
    assert all(tokens == runs["plain"] for tokens in runs.values())
    lines = ["The quick brown fox", "for i in range(10):\n    print(i * i)\n", "Question: what is 12 plus 30?"]
    prompts_file.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in lines))
    bench = dflash_ok("bench", *common, "--dataset", str(prompts_file), "--max-new-tokens", "16", "--json")
    doc = json.loads(bench.stdout)
    assert doc["lossless"]["checked"] and doc["lossless"]["mismatches"] == []
    return doc


def prefix_and_static(pair: TinyPair, root: Path, hf_class=None, **export: Any):
    """(engine as built: ONNX Runtime's prefix-cache graphs, engine on the static graphs: what QAIC gets,
    the target as Hugging Face loads it: `hf_class`, else its causal LM), the graphs exported with logits
    (sampling needs them) and `export` settings."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_cli.decoding.engine import Engine
    from dflash_cli.recipe.schema import load_recipe

    recipe, cache = build_recipe(pair, root, export={"logits": True, **export})
    prefix = Engine.load(recipe, cache)
    assert type(prefix.target).__name__ != "OrtSession", "the build should run the prefix-cache target"
    static = Engine.load(load_recipe(str(root / "recipe.yaml"), ["compile.ort.prefix_cache=false"]), cache)
    assert type(static.target).__name__ == "OrtSession"
    hf = (hf_class or AutoModelForCausalLM).from_pretrained(str(pair.target_dir), dtype=torch.float32).eval()
    return prefix, static, hf


def assert_sampling_same_seed(engine, vocab: int, modes, n: int = 8) -> None:
    """Same-seed sampled output of every mode == plain's, on `n` mixed prompts."""
    for seed, prompt in enumerate(mixed_prompts(vocab, n)):
        runs = {
            m: engine.generate(prompt, mode=m, max_new_tokens=16, temperature=0.8, top_p=0.95, seed=seed).tokens
            for m in modes
        }
        assert all(r == runs["plain"] for r in runs.values()), f"seed {seed}"
