"""Repetition penalty: the same processed logits as Hugging Face's, and speculative decoding still equal to plain
decoding under it (greedy and sampled), in every mode."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_cli.decoding.penalty import RepetitionPenalty
from dflash_cli.errors import GenerationError
from tests.engines import mixed_prompts

MODES = ("plain", "dflash", "lookup", "hybrid")


def test_penalised_row_equals_hugging_faces_processor():
    import torch
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(0)
    row = rng.normal(0, 3, 64).astype(np.float32)
    seen = [3, 3, 10, 63, 0]
    want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), torch.tensor(row[None].copy()))[0].numpy()
    got = RepetitionPenalty(1.3, seen, 64).penalised(row)
    assert np.array_equal(got, want)
    assert not np.array_equal(got, row)  # seen tokens changed: positive ones down, negative ones further down


class _Greedy:
    def pick(self, row, greedy_token):
        return int(greedy_token)


def test_a_picked_token_is_penalised_from_the_next_position_on():
    penalty = RepetitionPenalty(2.0, [], 4)
    row = np.array([1.0, 3.0, 2.5, -1.0], dtype=np.float32)
    assert penalty.pick(row, _Greedy()) == 1  # 3.0 is the largest
    assert penalty.pick(row, _Greedy()) == 2  # 1 was seen: 1.5 < 2.5
    assert penalty.cut([5, 6, 7], 2) == [5, 6]


def test_every_mode_equals_plain_under_the_penalty_and_the_penalty_changes_the_text(qwen3_logits_engine):
    engine = qwen3_logits_engine
    changed = 0
    for prompt in mixed_prompts(engine.vocab_size, n=10, seed=3):
        runs = {m: engine.generate(prompt, mode=m, max_new_tokens=16, repetition_penalty=1.5) for m in MODES}
        for mode, res in runs.items():
            assert res.tokens == runs["plain"].tokens, mode
        changed += runs["plain"].tokens != engine.generate(prompt, mode="plain", max_new_tokens=16).tokens
    assert changed > 0


def test_sampled_under_the_penalty_every_mode_draws_plains_text(qwen3_logits_engine):
    engine = qwen3_logits_engine
    for prompt in mixed_prompts(engine.vocab_size, n=4, seed=8):
        kw = {"max_new_tokens": 12, "temperature": 0.9, "seed": 5, "repetition_penalty": 1.3}
        plain = engine.generate(prompt, mode="plain", **kw).tokens
        for mode in MODES[1:]:
            assert engine.generate(prompt, mode=mode, **kw).tokens == plain, mode


def test_greedy_under_the_penalty_equals_hugging_faces_generate(qwen3_logits_engine, tiny_qwen3_pair):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_pair.target_dir), dtype=torch.float32).eval()
    engine = qwen3_logits_engine
    for prompt in mixed_prompts(engine.vocab_size, n=6, seed=21)[1:]:
        res = engine.generate(prompt, mode="dflash", max_new_tokens=12, repetition_penalty=1.3)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3)
        assert res.tokens == out[0, len(prompt) :].tolist()  # both end at end of text, where it comes


def test_a_build_without_logits_refuses_the_penalty_in_one_line(qwen3_engine):
    with pytest.raises(GenerationError, match="export.logits=true"):
        qwen3_engine.generate([5, 6, 7], mode="dflash", max_new_tokens=4, repetition_penalty=1.2)
    with pytest.raises(GenerationError, match="not positive"):
        qwen3_engine.generate([5, 6, 7], mode="dflash", max_new_tokens=4, repetition_penalty=0.0)
