"""Sampling stays lossless in distribution: DFlash's next tokens follow the target's own distribution.

A target with a 16-token vocabulary and peaked logits is sampled at temperature 1; the exact
distribution of the first three generated tokens is enumerated with Hugging Face, and both plain
sampling and DFlash are tested against it with a chi-square goodness-of-fit test. A deliberately
biased sampler (temperature 0.8 applied secretly) must fail the same test, so the test has power.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dflash_cli.decoding.sampling import SamplingConfig, target_probs

VOCAB = 16
PROMPT = [2, 3, 4, 5]
N = 600


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from tests.engines import open_engine
    from tests.fixtures.tiny_pairs import TinyPair, write_dflash_draft, write_qwen3_target

    root = tmp_path_factory.mktemp("small_vocab")
    target = write_qwen3_target(root / "target", vocab=VOCAB, seed=3)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.embed_tokens.weight"] *= 4.0  # peaked (low-entropy) next-token distributions
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    draft = write_dflash_draft(root / "draft", target, block_size=4, seed=3)
    pair = TinyPair("qwen3", target, draft, 4, 1)
    # Whole-block verifies: the test needs proposals checked, not cut short by the verify-length choice.
    engine = open_engine(pair, root, export={"logits": True}, run={"verify": "block"})
    return engine, target


def exact_joint(target_dir, steps: int) -> dict[tuple[int, ...], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    cfg = SamplingConfig(temperature=1.0)
    joint = {(): 1.0}
    with torch.no_grad():
        for _ in range(steps):
            nxt = {}
            for prefix, p in joint.items():
                if p < 1e-9:
                    continue
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].numpy()
                for tok, q in enumerate(target_probs(logits, cfg)):
                    nxt[prefix + (tok,)] = p * q
            joint = nxt
    return joint


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.09: alpha ~ 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> tuple[float, int]:
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    # Pool outcomes with small expected counts into one bin so the chi-square approximation holds.
    big = [k for k, p in exact.items() if p * len(samples) >= 5]
    stat, rest_obs, rest_exp = 0.0, len(samples), len(samples)
    for k in big:
        e = exact[k] * len(samples)
        o = counts.get(k, 0)
        stat += (o - e) ** 2 / e
        rest_obs -= o
        rest_exp -= e
    if rest_exp >= 1:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
    return stat, max(1, len(big) - (0 if rest_exp >= 1 else 1))


def sample(engine, mode: str, seeds, temperature=1.0) -> list[tuple[int, ...]]:
    return [
        tuple(engine.generate(PROMPT, mode=mode, max_new_tokens=3, temperature=temperature, seed=s).tokens[:3])
        for s in seeds
    ]


def test_dflash_sampling_matches_target_distribution(small_vocab):
    engine, target_dir = small_vocab
    exact = exact_joint(target_dir, 3)
    assert max(exact.values()) < 0.9  # not degenerate: the test needs real randomness
    plain = sample(engine, "plain", range(N))
    dflash = sample(engine, "dflash", range(10_000, 10_000 + N))
    for name, samples in (("plain", plain), ("dflash", dflash)):
        stat, df = chi2_statistic(samples, exact)
        assert stat < chi2_critical(df), f"{name}: chi2 {stat:.1f} over critical {chi2_critical(df):.1f} (df {df})"
    # The draft must actually have been accepted sometimes, or this would only test plain sampling.
    res = [engine.generate(PROMPT, mode="dflash", max_new_tokens=24, temperature=1.0, seed=s) for s in range(50)]
    assert any(a > 1 for r in res for a in r.accept_lengths)


def test_biased_sampler_is_caught(small_vocab):
    engine, target_dir = small_vocab
    exact = exact_joint(target_dir, 3)
    biased = sample(engine, "dflash", range(20_000, 20_000 + N), temperature=0.6)
    stat, df = chi2_statistic(biased, exact)
    assert stat > chi2_critical(df)


def test_same_seed_gives_same_text_in_both_modes(small_vocab):
    """One uniform per committed token: DFlash consumes the random stream exactly like plain decoding."""
    engine, _ = small_vocab
    for seed in range(20):
        a = engine.generate(PROMPT, mode="plain", max_new_tokens=12, temperature=1.0, seed=seed).tokens
        b = engine.generate(PROMPT, mode="dflash", max_new_tokens=12, temperature=1.0, seed=seed).tokens
        assert a == b


def test_top_k_top_p_restrict_support():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert np.count_nonzero(p) == 2 and math.isclose(p.sum(), 1.0)
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.5))
    assert np.count_nonzero(p) == 1
    p = target_probs(logits, SamplingConfig(temperature=1.0, top_p=0.9))
    assert 1 < np.count_nonzero(p) < 5


def test_enumeration_is_a_distribution(small_vocab):
    _, target_dir = small_vocab
    exact = exact_joint(target_dir, 1)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-6)
    assert all(len(k) == 1 for k in itertools.islice(exact, 3))
