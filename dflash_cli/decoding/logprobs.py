"""The target's log-probabilities of committed tokens, from the logits row that chose each one.

A verify block's row for a position holds the same logits a one-token call gives that position (the build
checks call-length invariance), so every mode reports the numbers plain decoding reports. They are the raw
distribution (log-softmax of the logits, before temperature, top-k or top-p), as OpenAI's and vLLM's
`logprobs` are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # alternatives per position a request may ask for (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens and their logprobs, likeliest first


def log_softmax(row: np.ndarray) -> np.ndarray:
    """float64 log-softmax of one logits row (float64: the sum over a 150k vocabulary keeps its digits)."""
    z = np.asarray(row, dtype=np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def entry(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s logprob under `row`, with the `top` likeliest tokens (ties: the lower id first)."""
    lp = log_softmax(row)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = np.argpartition(-lp, min(top, lp.size) - 1)[:top] if top < lp.size else np.arange(lp.size)
        ids = sorted(ids.tolist(), key=lambda i: (-lp[i], i))
        best = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprob(int(token), float(lp[token]), best)


def prompt_entries(logits: np.ndarray, prompt: list[int], top: int) -> list[TokenLogprob | None]:
    """Each prompt token's logprob given the tokens before it (the first has none: None), from the
    prefill's logits rows [len(prompt), vocab]."""
    return [None] + [entry(logits[i], prompt[i + 1], top) for i in range(len(prompt) - 1)]
