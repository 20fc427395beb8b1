"""How much of a DFlash block to verify: the draft's own confidence per position against the verify's cost.

A verify of L tokens (the last committed one and L-1 proposals) commits 1 + (proposals accepted in a row),
so its expected yield is 1 + sum_k prod_{j<=k} a_j, where a_j is the chance proposal j is accepted given
every one before it was. On a CPU a verify's cost grows with L (an int4 call of 16 rows costs 3.6x a
one-row call on the 0.6B shape, 5.5x on the 4B one), so verifying the whole block after a draft that is
unsure past its second token throws most of the call away. Each step picks the L that maximises
    E[committed | L] - rate * T_verify(L)
(the hybrid's rule, decoding/hybrid.py: the time a step spends is worth `rate` tokens per second, the loop's
long-run rate). The draft's cost is paid before the choice and does not depend on L.

a_j comes from the draft graph's `draft_confidence` (its probability of the token it proposed), calibrated
online: per confidence bin, how often a proposal that was reached was accepted. A draft's probabilities are
not acceptance rates (a draft trained on a target's greedy outputs is over- or under-confident by bin), and
the calibration learns the difference on the pair at hand. Lossless either way: only fewer proposals get
verified, and the target verifies every token it commits.
"""

from __future__ import annotations

BINS = 10  # equal-width bins of the draft's probability
PRIOR_WEIGHT = 4.0  # pseudo-proposals per bin behind the prior "accepted at the draft's own probability"


class Calibration:
    """P(a proposal is accepted | it was reached, the draft gave it probability p), per bin of p."""

    def __init__(self) -> None:
        self.reached = [PRIOR_WEIGHT] * BINS
        self.accepted = [PRIOR_WEIGHT * (b + 0.5) / BINS for b in range(BINS)]

    @staticmethod
    def _bin(p: float) -> int:
        return min(BINS - 1, max(0, int(p * BINS)))

    def accept(self, p: float) -> float:
        b = self._bin(p)
        return self.accepted[b] / self.reached[b]

    def add(self, p: float, accepted: bool) -> None:
        b = self._bin(p)
        self.reached[b] += 1.0
        self.accepted[b] += 1.0 if accepted else 0.0

    def learn(self, confidence: list[float], proposal: list[int], committed: list[int]) -> None:
        """Every proposal the verify reached: accepted where it equals the committed token."""
        for i, p in enumerate(confidence[: len(proposal)]):
            if i >= len(committed):
                break
            self.add(p, proposal[i] == committed[i])
            if proposal[i] != committed[i]:
                break


def expected_committed(accept: list[float]) -> list[float]:
    """[E[committed | L] for L = 1 .. len(accept) + 1] given per-proposal acceptance chances."""
    table, alive, total = [1.0], 1.0, 1.0
    for a in accept:
        alive *= a
        total += alive
        table.append(total)
    return table


def choose_length(accept: list[float], verify_seconds, rate: float | None) -> int:
    """The verify length (1 .. len(accept) + 1) worth the most: E[committed | L] - rate * T_verify(L).
    `verify_seconds` (length -> seconds) is None before any verify was timed, as is `rate` before the first
    step: then the whole block (what there is to learn from)."""
    full = len(accept) + 1
    if rate is None or verify_seconds is None:
        return full
    table = expected_committed(accept)
    best, choice = None, full
    for length in range(1, full + 1):
        value = table[length - 1] - rate * verify_seconds(length)
        if best is None or value > best + 1e-12:
            best, choice = value, length
    return choice


class VerifyBudget:
    """What a DFlash loop decides its verify lengths by; kept on the engine, so later requests start informed:
    the calibration, and (the hybrid's own bookkeeping, decoding/hybrid.py) the loop's long-run rate and a
    line fitted to the verify times by length."""

    def __init__(self, block_size: int) -> None:
        from dflash_cli.decoding.hybrid import HybridStats

        self.calibration = Calibration()
        self.costs = HybridStats(block_size)

    def length(self, confidence: list[float]) -> int:
        accept = [self.calibration.accept(p) for p in confidence]
        return choose_length(accept, self.costs.verify_line(), self.costs.rate())

    def learn(self, confidence: list[float], proposal: list[int], committed: list[int], verify_s: float, step_s: float):
        self.calibration.learn(confidence, proposal, committed)
        self.costs.add_step(len(committed), step_s)
        if verify_s > 0:
            self.costs.add_verify(len(proposal) + 1, verify_s)
