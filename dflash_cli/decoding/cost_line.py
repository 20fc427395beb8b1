"""Seconds of a model call as a function of how many rows it carries, learnt from the calls a loop times.

The hybrid and the DFlash loop choose lengths by it (a verify's, a draft's): one line fitted to every call
(seconds = a + b * length, older calls decayed by MEMORY), because per-length means drift apart by where and
when each length happened to be chosen (a length tried a few times in a slow minute kept its bad mean for the
rest of a run). With one length timed: its mean, and below it a guess proportional to the length and above it
its cost (optimistic on purpose: they get tried).
"""

from __future__ import annotations

MEMORY = 0.995  # per call, the weight older calls keep in the fit


class CostLine:
    def __init__(self, longest: int) -> None:
        self.timed = [[0.0, 0] for _ in range(longest + 1)]  # per length: seconds, calls
        self._fit = [0.0, 0.0, 0.0, 0.0, 0.0]  # decayed sums: weight, L, L^2, t, L*t

    def add(self, length: int, seconds: float) -> None:
        self.timed[length][0] += seconds
        self.timed[length][1] += 1
        sample = (1.0, length, length * length, seconds, length * seconds)
        self._fit = [MEMORY * old + new for old, new in zip(self._fit, sample)]

    def line(self):
        """length -> seconds, or None before any call was timed."""
        seen = [(k, s / c) for k, (s, c) in enumerate(self.timed) if c]
        if not seen:
            return None
        if len(seen) == 1:
            k, t = seen[0]
            return lambda length: t * length / k if length < k else t
        w, sl, sll, st, slt = self._fit
        var = w * sll - sl * sl
        slope = (w * slt - sl * st) / var if var > 0 else 0.0
        if slope <= 0:  # noise swamped the per-row cost: every length costs the mean
            return lambda length: st / w
        base = (st - slope * sl) / w
        return lambda length: base + slope * length
