"""Bench metrics on hand-computed examples."""

from __future__ import annotations

import pytest

from dflash_cli.bench import metrics
from dflash_cli.decoding.result import GenerationResult


def _gen(n_tokens: int, decode_s: float, accepts: list[int] | None = None, **kw: object) -> GenerationResult:
    return GenerationResult(
        mode=kw.pop("mode", "dflash"),
        prompt_tokens=5,
        tokens=list(range(n_tokens)),
        accept_lengths=accepts or [],
        decode_s=decode_s,
        **kw,
    )


def test_speedup_over_totals_not_mean_of_ratios() -> None:
    # plain: 10 + 30 decode tokens in 0.1 + 0.3 s -> 10 ms/token
    plain = [_gen(11, 0.1, mode="plain"), _gen(31, 0.3, mode="plain")]
    # dflash: 40 decode tokens in 0.02 + 0.18 = 0.2 s -> 5 ms/token
    dflash = [_gen(11, 0.02), _gen(31, 0.18)]
    assert metrics.time_per_output_token(plain) == pytest.approx(0.01)
    assert metrics.decode_speedup(plain, dflash) == pytest.approx(2.0)
    # per pair: 10 ms / 2 ms = 5x and 10 ms / 6 ms = 1.667x; the median of two is their mean
    assert metrics.median_pairwise_speedup(plain, dflash) == pytest.approx((5 + 10 / 6) / 2)
    assert metrics.decode_tokens_per_s(dflash) == pytest.approx(200.0)


def test_speedup_without_decode_is_zero() -> None:
    assert metrics.decode_speedup([_gen(1, 0.0)], [_gen(1, 0.0)]) == 0.0


def test_tau_is_committed_over_steps() -> None:
    results = [_gen(8, 1.0, [4, 3]), _gen(4, 1.0, [1, 1, 1, 2])]
    assert metrics.mean_acceptance_length(results) == pytest.approx(12 / 6)
    assert metrics.mean_acceptance_length([_gen(3, 1.0, mode="plain")]) == 1.0


def test_per_sample_tau_averages_each_generation_first() -> None:
    results = [_gen(8, 1.0, [4, 3]), _gen(4, 1.0, [1, 1, 1, 2])]
    # (7/2 + 5/4) / 2, where the pooled tau is 12/6
    assert metrics.mean_acceptance_length_per_sample(results) == pytest.approx((3.5 + 1.25) / 2)
    assert metrics.mean_acceptance_length_per_sample([_gen(3, 1.0, mode="plain")]) == 1.0


def test_acceptance_histogram() -> None:
    results = [_gen(9, 1.0, [4, 1, 1]), _gen(9, 1.0, [2, 4])]
    hist = metrics.acceptance_histogram(results, block_size=4)
    assert hist["lengths"] == [1, 2, 3, 4]
    assert hist["counts"] == [2, 1, 0, 2]
    assert hist["fractions"] == pytest.approx([0.4, 0.2, 0.0, 0.4])


def test_acceptance_histogram_rejects_impossible_lengths() -> None:
    with pytest.raises(ValueError, match="outside 1..4"):
        metrics.acceptance_histogram([_gen(9, 1.0, [5])], block_size=4)


def test_per_position_acceptance() -> None:
    # accept lengths 1, 2, 4, 4 -> accepted drafts 0, 1, 3, 3
    results = [_gen(12, 1.0, [1, 2, 4, 4])]
    rates = metrics.per_position_acceptance(results, block_size=5)
    # k=1: 3 of 4 steps; k=2: 2 of the 3 that reached it; k=3: 2 of 2; k=4: none accepted 4 drafts, 2 reached it
    assert rates == pytest.approx([3 / 4, 2 / 3, 1.0, 0.0])


def test_per_position_unreached_is_none() -> None:
    assert metrics.per_position_acceptance([_gen(3, 1.0, [1, 1])], block_size=3) == [0.0, None]


def test_ttft_stats() -> None:
    results = [_gen(2, 1.0, prefill_s=p) for p in (0.1, 0.2, 0.6)]
    assert metrics.ttft_stats(results) == pytest.approx({"median": 0.2, "mean": 0.3})


def test_repetition_rate_hand_computed() -> None:
    # 4-grams of [1,2,3,4,1,2,3,4,5]: 1234 2341 3412 4123 1234* 2345 -> one repeat among the 5 after the first
    assert metrics.repetition_rate([1, 2, 3, 4, 1, 2, 3, 4, 5], n=4) == pytest.approx(1 / 5)
    assert metrics.repetition_rate(list(range(20))) == 0.0
    # a constant loop: every 8-gram after the first repeats it
    assert metrics.repetition_rate([7] * 20) == 1.0
    assert metrics.repetition_rate([1] * 8) == 0.0  # a single 8-gram cannot repeat


def test_median_repetition_rate() -> None:
    results = [_gen(0, 1.0) for _ in range(3)]
    results[0].tokens, results[1].tokens, results[2].tokens = [7] * 20, list(range(20)), [1, 2] * 10
    # rates 1.0, 0.0 and 11/12 (the alternation's second 8-gram is new, the other 11 repeat)
    assert metrics.median_repetition_rate(results) == pytest.approx(11 / 12)


def test_ceiling_bandwidth_and_overhead() -> None:
    assert metrics.ceiling_speedup(tau=4.0, t1=0.01, t_verify=0.015, t_draft=0.005) == pytest.approx(2.0)
    # 10 target calls in 0.5 s -> 20 steps/s; 2.5 GB of weights per step -> 50 GB/s
    results = [_gen(21, 0.5, [2] * 10, target_calls=10, target_s=0.3, draft_s=0.1)]
    assert metrics.weight_bandwidth_gb_s(results, 2_500_000_000) == pytest.approx(50.0)
    assert metrics.loop_overhead_fraction(results) == pytest.approx(0.2)


def test_end_to_end_includes_prefill() -> None:
    results = [_gen(10, 0.9, prefill_s=0.1)]
    assert metrics.end_to_end_tokens_per_s(results) == pytest.approx(10.0)
