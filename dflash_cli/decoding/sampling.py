"""Token selection: greedy, or temperature / top-k / top-p with one uniform draw per committed token.

Drawing exactly one uniform per committed token (inverse CDF) means DFlash's verify, which draws
the target's token position by position and stops at the first mismatch, consumes the random
stream exactly as plain decoding does: with the same seed both produce the same text, and the
output is distributed as target-only sampling (REFERENCE section 7, one-hot proposal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def target_probs(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Processed target distribution over the vocabulary for one position."""
    z = logits.astype(np.float64) / cfg.temperature
    if cfg.top_k and cfg.top_k < z.shape[-1]:
        kth = np.partition(z, -cfg.top_k)[-cfg.top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    if cfg.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = cum - p[order] < cfg.top_p  # smallest prefix whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


class Sampler:
    def __init__(self, cfg: SamplingConfig) -> None:
        self.cfg = cfg
        self._rng = np.random.default_rng(cfg.seed)

    def pick(self, logits: np.ndarray | None, greedy_token: int) -> int:
        """The target's token at one position (greedy uses the graph's argmax)."""
        if self.cfg.greedy:
            return int(greedy_token)
        p = target_probs(logits, self.cfg)
        u = self._rng.random()
        return int(min(np.searchsorted(np.cumsum(p), u, side="right"), len(p) - 1))
