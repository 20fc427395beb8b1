"""Benchmark metrics as the field reports them, as pure functions over GenerationResults.

Conventions (REFERENCE section 8):
* decode excludes prefill: the first token is TTFT, "decode" is every token after it;
* ratios over a set are computed over totals (sum of seconds / sum of tokens), so long
  generations weigh by their length and a few short ones cannot skew the mean;
* tau (mean acceptance length) counts the bonus token, so it lies in 1..block_size (1..the longest
  verify for the hybrid, whose lookup steps may verify past the block).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from dflash_cli.decoding.result import GenerationResult

REPETITION_NGRAM = 8


def _steps(results: Iterable[GenerationResult]) -> list[int]:
    return [a for r in results for a in r.accept_lengths]


def total_decode_s(results: Sequence[GenerationResult]) -> float:
    return sum(r.decode_s for r in results)


def total_decode_tokens(results: Sequence[GenerationResult]) -> int:
    return sum(r.decode_tokens for r in results)


def time_per_output_token(results: Sequence[GenerationResult]) -> float:
    """Decode seconds per decode token over the whole set (0.0 when nothing was decoded)."""
    tokens = total_decode_tokens(results)
    return total_decode_s(results) / tokens if tokens else 0.0


def decode_tokens_per_s(results: Sequence[GenerationResult]) -> float:
    seconds = total_decode_s(results)
    return total_decode_tokens(results) / seconds if seconds > 0 else 0.0


def end_to_end_tokens_per_s(results: Sequence[GenerationResult]) -> float:
    """All new tokens over prefill + decode time: what a user waiting for the whole answer sees."""
    seconds = sum(r.prefill_s + r.decode_s for r in results)
    return sum(r.new_tokens for r in results) / seconds if seconds > 0 else 0.0


def decode_speedup(baseline: Sequence[GenerationResult], candidate: Sequence[GenerationResult]) -> float:
    """Baseline time-per-output-token / candidate time-per-output-token, over totals (decode only)."""
    base, cand = time_per_output_token(baseline), time_per_output_token(candidate)
    return base / cand if base > 0 and cand > 0 else 0.0


def median_pairwise_speedup(baseline: Sequence[GenerationResult], candidate: Sequence[GenerationResult]) -> float:
    """Median over paired generations (same prompt) of the per-generation TPOT ratio."""
    if len(baseline) != len(candidate):
        raise ValueError(f"unpaired results: {len(baseline)} baseline vs {len(candidate)} candidate")
    ratios = [
        b.time_per_output_token / c.time_per_output_token
        for b, c in zip(baseline, candidate, strict=True)
        if b.time_per_output_token > 0 and c.time_per_output_token > 0
    ]
    return statistics.median(ratios) if ratios else 0.0


def mean_acceptance_length(results: Sequence[GenerationResult]) -> float:
    """tau: committed tokens / verify steps over the set; 1.0 when no step ran (as for plain decoding)."""
    steps = _steps(results)
    return sum(steps) / len(steps) if steps else 1.0


def mean_acceptance_length_per_sample(results: Sequence[GenerationResult]) -> float:
    """tau averaged per generation first, then over generations (how z-lab's benchmark.py reports it).

    Looping prompts finish in few long steps, so this weighs them more than the pooled tau does;
    both are reported so numbers compare with either convention.
    """
    taus = [sum(r.accept_lengths) / len(r.accept_lengths) for r in results if r.accept_lengths]
    return statistics.fmean(taus) if taus else 1.0


def acceptance_histogram(results: Sequence[GenerationResult], block_size: int) -> dict[str, list]:
    """How many verify steps committed 1..block_size tokens: `lengths`, `counts`, `fractions` (block_size:
    the longest verify, for the hybrid)."""
    counts = [0] * block_size
    for length in _steps(results):
        if not 1 <= length <= block_size:
            # A step commits at least the bonus token and at most what it verified; anything else is a loop bug.
            raise ValueError(f"accept length {length} outside 1..{block_size}")
        counts[length - 1] += 1
    total = sum(counts)
    fractions = [c / total if total else 0.0 for c in counts]
    return {"lengths": list(range(1, block_size + 1)), "counts": counts, "fractions": fractions}


def per_position_acceptance(results: Sequence[GenerationResult], block_size: int) -> list[float | None]:
    """For draft position k = 1..block_size-1: P(token k accepted | the step reached position k).

    A step with accept length `a` accepted `a - 1` draft tokens, so it reached position k when
    `a - 1 >= k - 1` and accepted it when `a - 1 >= k`. None where no step reached k.
    """
    accepted = [a - 1 for a in _steps(results)]
    rates: list[float | None] = []
    for k in range(1, block_size):
        reached = sum(1 for n in accepted if n >= k - 1)
        rates.append(sum(1 for n in accepted if n >= k) / reached if reached else None)
    return rates


def ttft_stats(results: Sequence[GenerationResult]) -> dict[str, float]:
    """Time to first token (prefill + first token): median and mean seconds."""
    values = [r.prefill_s for r in results]
    if not values:
        return {"median": 0.0, "mean": 0.0}
    return {"median": statistics.median(values), "mean": statistics.fmean(values)}


def repetition_rate(tokens: Sequence[int], n: int = REPETITION_NGRAM) -> float:
    """Fraction of the generated n-grams already seen earlier in the same sequence.

    Over generated tokens only (the prompt is not history); the first n-gram cannot repeat and
    is left out of the denominator. 0.0 for sequences with fewer than two n-grams. A degenerate
    loop ("the the the ...") scores near 1, which also inflates tau, so it is reported beside it.
    """
    total = len(tokens) - n + 1
    if total < 2:
        return 0.0
    seen = {tuple(tokens[0:n])}
    repeats = 0
    for start in range(1, total):
        gram = tuple(tokens[start : start + n])
        if gram in seen:
            repeats += 1
        else:
            seen.add(gram)
    return repeats / (total - 1)


def median_repetition_rate(results: Sequence[GenerationResult], n: int = REPETITION_NGRAM) -> float:
    rates = [repetition_rate(r.tokens, n) for r in results]
    return statistics.median(rates) if rates else 0.0


def decode_steps(result: GenerationResult) -> int:
    """Decode-phase target calls (plain steps or verify steps), with fallbacks for sparse results."""
    return result.target_calls or len(result.accept_lengths) or result.decode_tokens


def steps_per_s(results: Sequence[GenerationResult]) -> float:
    seconds = total_decode_s(results)
    return sum(decode_steps(r) for r in results) / seconds if seconds > 0 else 0.0


def weight_bandwidth_gb_s(results: Sequence[GenerationResult], weight_bytes: int) -> float:
    """Achieved weight bandwidth: bytes of weights read per step x steps per second (KV cache not counted).

    Pass target bytes for plain decoding and target + draft bytes for speculative decoding: each
    step reads every weight once, so this ties the measured speed to the hardware's memory limit.
    """
    return weight_bytes * steps_per_s(results) / 1e9


def loop_overhead_fraction(results: Sequence[GenerationResult]) -> float:
    """Share of decode time spent outside session calls (Python loop, sampling, bookkeeping)."""
    seconds = total_decode_s(results)
    return sum(r.loop_overhead_s for r in results) / seconds if seconds > 0 else 0.0


def ceiling_speedup(tau: float, t1: float, t_verify: float, t_draft: float) -> float:
    """Best decode speedup for a measured tau: tau * T(1) / (T_verify(B) + T_draft(B))."""
    step = t_verify + t_draft
    return tau * t1 / step if step > 0 else 0.0


def source_split(results: list[GenerationResult]) -> dict[str, dict[str, float]]:
    """Hybrid runs: per proposer, its verify steps, their share, and its mean acceptance length."""
    steps: dict[str, list[int]] = {}
    verified: dict[str, list[int]] = {}
    for r in results:
        lengths = r.verify_lengths or [r.block_size] * len(r.accept_lengths)
        for source, accepted, length in zip(r.step_sources, r.accept_lengths, lengths):
            steps.setdefault(source, []).append(accepted)
            verified.setdefault(source, []).append(length)
    total = sum(len(v) for v in steps.values())
    return {
        source: {
            "steps": len(v),
            "share": len(v) / total if total else 0.0,
            "mean_acceptance_length": sum(v) / len(v),
            "committed_tokens": sum(v),
            "mean_verify_tokens": sum(verified[source]) / len(v),
        }
        for source, v in sorted(steps.items())
    }
