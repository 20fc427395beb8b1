"""Repetition penalty: every token already in the prompt or the answer has its logit divided by the penalty
(multiplied where negative), as Hugging Face's `repetition_penalty` does, before the token is picked.

The penalised row of a position depends only on the tokens before it, which the loops know exactly: a verify
block's row i is read only when the proposal's first i tokens were all accepted, i.e. equal to the tokens picked
at rows 0..i-1. So picking position by position through a verify block, adding each picked token to the seen set,
gives each row the same penalty a one-token call would, and speculative decoding equals plain decoding under the
penalty, token for token (greedy: the likeliest penalised token; sampled: the same draws). It needs the logits
(export.logits=true). A grammar (decoding/constraint.py) masks the penalised row where both are asked.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class RepetitionPenalty:
    """One generation's penalty state, with the loops' `pick` / `cut` interface (decoding/loops.py)."""

    def __init__(self, penalty: float, prompt: list[int], vocab_size: int, grammar: Any = None) -> None:
        self.penalty = np.float32(penalty)
        self.grammar = grammar
        self.seen = np.zeros(vocab_size, dtype=bool)
        self.seen[[t for t in prompt if 0 <= t < vocab_size]] = True

    def penalised(self, row: np.ndarray) -> np.ndarray:
        """`row` (float32, as Hugging Face's processor computes) with the seen tokens' logits penalised."""
        row = np.asarray(row, dtype=np.float32)
        width = min(row.shape[-1], self.seen.shape[0])
        seen = np.zeros(row.shape[-1], dtype=bool)
        seen[:width] = self.seen[:width]
        return np.where(seen, np.where(row < 0, row * self.penalty, row / self.penalty), row)

    def pick(self, row: np.ndarray, sampler: Any) -> int:
        processed = self.penalised(row)
        if self.grammar is not None:
            token = self.grammar.pick(processed, sampler)
        else:
            token = sampler.pick(processed, int(np.argmax(processed)))
        if 0 <= token < self.seen.shape[0]:
            self.seen[token] = True
        return token

    def cut(self, proposal: list[int], limit: int) -> list[int]:
        """The proposal as the grammar (if any) cuts it; the penalty forbids nothing."""
        return self.grammar.cut(proposal, limit) if self.grammar is not None else proposal[:limit]
