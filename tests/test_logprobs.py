"""Logprobs: the target's log-probabilities of each committed (and, where asked, each prompt) token, the same in
every mode as in plain decoding, and what Hugging Face's own model gives."""

from __future__ import annotations

import math

import pytest

from tests.engines import mixed_prompts

MODES = ("plain", "dflash", "lookup", "hybrid")


@pytest.fixture(scope="module")
def hf(tiny_qwen3_pair):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_pair.target_dir), dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]):
    """[len(ids), vocab] log-softmax of Hugging Face's logits over `ids`."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def test_every_mode_reports_plain_decodings_logprobs_bit_for_bit(qwen3_logits_engine):
    engine = qwen3_logits_engine
    for prompt in mixed_prompts(engine.vocab_size, n=8, seed=11):
        runs = {m: engine.generate(prompt, mode=m, max_new_tokens=12, logprobs=3) for m in MODES}
        plain = runs["plain"]
        assert len(plain.logprobs) == len(plain.tokens) and plain.prompt_logprobs is None
        for mode, res in runs.items():
            assert res.tokens == plain.tokens and res.logprobs == plain.logprobs, mode
        for got, token in zip(plain.logprobs, plain.tokens):
            assert got.token == token and len(got.top) == 3
            assert got.top[0] == (token, got.logprob)  # greedy picks the likeliest
            assert [lp for _, lp in got.top] == sorted((lp for _, lp in got.top), reverse=True)


def test_logprobs_and_prompt_logprobs_equal_hugging_faces(qwen3_logits_engine, hf):
    engine = qwen3_logits_engine
    for prompt in mixed_prompts(engine.vocab_size, n=4, seed=5)[1:]:
        res = engine.generate(prompt, mode="dflash", max_new_tokens=8, logprobs=2, prompt_logprobs=True)
        want = hf_logprobs(hf, prompt + res.tokens)
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
        for i, got in enumerate(res.prompt_logprobs[1:], start=1):
            assert got.token == prompt[i] and math.isclose(got.logprob, want[i - 1, prompt[i]], abs_tol=1e-4)
        for j, got in enumerate(res.logprobs):
            row = want[len(prompt) - 1 + j]
            assert math.isclose(got.logprob, row[res.tokens[j]], abs_tol=1e-4)
            assert math.isclose(math.fsum(math.exp(v) for v in row.tolist()), 1.0, abs_tol=1e-9)


def test_sampled_tokens_get_the_raw_distributions_logprob(qwen3_logits_engine):
    """Under temperature the logprob is the model's own (before temperature), as OpenAI reports it."""
    engine = qwen3_logits_engine
    prompt = mixed_prompts(engine.vocab_size, n=2, seed=3)[1]
    kw = dict(max_new_tokens=10, temperature=0.9, seed=4, logprobs=0)
    plain, spec = (engine.generate(prompt, mode=m, **kw) for m in ("plain", "dflash"))
    assert spec.tokens == plain.tokens and spec.logprobs == plain.logprobs
    assert all(e.top == () and e.logprob <= 0.0 for e in plain.logprobs)


def test_logprobs_are_refused_without_logits_and_beyond_twenty(qwen3_engine, qwen3_logits_engine):
    from dflash_cli.errors import GenerationError

    with pytest.raises(GenerationError, match="logprobs need logits") as caught:
        qwen3_engine.generate([5, 6, 7], max_new_tokens=2, logprobs=1)
    assert "export.logits=true" in caught.value.hint
    with pytest.raises(GenerationError, match="not in 0..20"):
        qwen3_logits_engine.generate([5, 6, 7], max_new_tokens=2, logprobs=21)
