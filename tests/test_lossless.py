"""Greedy DFlash == greedy plain decoding == Hugging Face `generate`, token for token (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

N_PROMPTS = 20
MAX_NEW = 24


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Lengths straddle the prefill chunk (8) and the block (4) so padding paths are exercised.
    return [list(map(int, rng.integers(2, vocab, size=int(n)))) for n in rng.integers(1, 30, size=N_PROMPTS)]


def _hf_greedy(target_dir, prompt: list[int], stop_ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_greedy.cache.get(str(target_dir))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        _hf_greedy.cache[str(target_dir)] = model
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=stop_ids[0],
    )
    return out[0, len(prompt) :].tolist()


_hf_greedy.cache = {}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_dflash_equals_plain_equals_hf(family, request):
    engine = request.getfixturevalue(f"{family}_engine")
    pair = request.getfixturevalue(f"tiny_{family}_pair")
    vocab = engine.tokenizer.vocab_size
    for i, prompt in enumerate(_prompts(vocab, seed=1 if family == "qwen3" else 2)):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=MAX_NEW)
        dflash = engine.generate(prompt, mode="dflash", max_new_tokens=MAX_NEW)
        lookup = engine.generate(prompt, mode="lookup", max_new_tokens=MAX_NEW)
        hf = _hf_greedy(pair.target_dir, prompt, engine.eos_token_ids)
        assert dflash.tokens == plain.tokens, f"prompt {i}: dflash differs from plain"
        assert lookup.tokens == plain.tokens, f"prompt {i}: prompt lookup differs from plain"
        assert plain.tokens == hf, f"prompt {i}: plain differs from Hugging Face generate"
        assert sum(dflash.accept_lengths) >= len(dflash.tokens) - 1
        assert all(1 <= a <= engine.block_size for a in dflash.accept_lengths)


def test_text_prompt_round_trip(qwen3_engine):
    ids = qwen3_engine.encode_prompt("def add(a, b):")
    res = qwen3_engine.generate(ids, mode="dflash", max_new_tokens=8)
    assert 1 <= res.new_tokens <= 8
    assert isinstance(qwen3_engine.decode(res.tokens), str)
