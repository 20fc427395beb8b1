"""The fields `vllm bench serve` and vLLM's spec-decode metrics define, computed from our generations.

Definitions (so numbers parse and compare as vLLM's do):
* one *draft* is one verify step; it proposes block_size - 1 *draft tokens*; *accepted tokens* are
  the draft tokens the target confirmed (the target's own bonus token is not counted);
* spec_decode_acceptance_length = 1 + accepted / drafts (our tau, pooled);
* spec_decode_acceptance_rate = accepted / draft tokens;
* spec_decode_per_position_acceptance_rates[i] = drafts whose token i was accepted / all drafts
  (unconditional; our `per_position_acceptance` is conditional on reaching position i);
* ttft/tpot in milliseconds per generation (TPOT = decode time / (new tokens - 1));
* completed = generations; duration = their prefill + decode seconds (modes interleave in one run,
  so each mode's own time, not the wall time); output_throughput = new tokens / duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash_cli.bench.spread import percentile
from dflash_cli.decoding.result import GenerationResult


def latency_fields(results: Sequence[GenerationResult]) -> dict[str, Any]:
    ttft = [r.prefill_s * 1000 for r in results]
    tpot = [r.time_per_output_token * 1000 for r in results if r.decode_tokens > 0]
    duration = sum(r.prefill_s + r.decode_s for r in results)
    out: dict[str, Any] = {"completed": len(results), "duration": duration}
    out["output_throughput"] = sum(r.new_tokens for r in results) / duration if duration > 0 else 0.0
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot)):
        out[f"mean_{name}"] = sum(values) / len(values) if values else None
        out[f"median_{name}"] = percentile(values, 50) if values else None
        out[f"p99_{name}"] = percentile(values, 99) if values else None
    return out


def spec_decode_fields(results: Sequence[GenerationResult], block_size: int) -> dict[str, Any]:
    """vLLM's speculative-decoding counters. A step proposed its verify length - 1 tokens: block_size - 1
    where every verify takes the block, fewer or (the hybrid's lookup steps) more where lengths vary."""
    steps = [
        (a - 1, length - 1)
        for r in results
        for a, length in zip(r.accept_lengths, r.verify_lengths or [block_size] * len(r.accept_lengths))
    ]
    accepted = [min(a, w) for a, w in steps]
    proposed = sum(w for _, w in steps)
    width = max([block_size - 1] + [w for _, w in steps])
    drafts = len(accepted)
    per_pos = [sum(1 for n in accepted if n > i) / drafts if drafts else None for i in range(width)]
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": proposed,
        "spec_decode_accepted_tokens": sum(accepted),
        "spec_decode_acceptance_length": 1 + sum(accepted) / drafts if drafts else None,
        "spec_decode_acceptance_rate": sum(accepted) / proposed if proposed else None,
        "spec_decode_per_position_acceptance_rates": per_pos,
    }
