"""How much of a DFlash block to verify: the draft's own confidence per position against the verify's cost.

A verify of L tokens (the last committed one and L-1 proposals) commits 1 + (proposals accepted in a row),
so its expected yield is 1 + sum_k prod_{j<=k} a_j, where a_j is the chance proposal j is accepted given
every one before it was. On a CPU a verify's cost grows with L (an int4 call of 16 rows costs 3.6x a
one-row call on the 0.6B shape, 5.5x on the 4B one), so verifying the whole block after a draft that is
unsure past its second token throws most of the call away. Each step picks the L that maximises
    E[committed | L] - rate * T_verify(L)
(the hybrid's rule, decoding/hybrid.py: the time a step spends is worth `rate` tokens per second, the loop's
long-run rate). The draft's cost is paid before the choice; how many rows it drafts is chosen before it runs
(draft_length.py).

a_j comes from the draft graph's `draft_confidence` (its probability of the token it proposed), calibrated
online: per confidence bin, how often a proposal that was reached was accepted. A draft's probabilities are
not acceptance rates (a draft trained on a target's greedy outputs is over- or under-confident by bin), and
the calibration learns the difference on the pair at hand. Lossless either way: only fewer proposals get
verified, and the target verifies every token it commits.
"""

from __future__ import annotations

BINS = 10  # equal-width bins of the draft's probability
DEPTHS = 4  # groups of block positions: the 1st proposal, the 2nd-3rd, 4th-7th, 8th on
PRIOR_WEIGHT = 4.0  # pseudo-proposals per cell behind the prior "accepted at the draft's own probability"


class Calibration:
    """P(a proposal is accepted | it was reached, the draft gave it probability p), per bin of p and per depth
    in the block: a proposal deep in a block is reached only after a run of accepted ones, which makes it
    likelier to be accepted than a first proposal of the same probability (on the demo pair, a calibration
    blind to depth made long drafts look worth less than they were)."""

    def __init__(self) -> None:
        self.reached = [[PRIOR_WEIGHT] * BINS for _ in range(DEPTHS)]
        self.accepted = [[PRIOR_WEIGHT * (b + 0.5) / BINS for b in range(BINS)] for _ in range(DEPTHS)]

    @staticmethod
    def _cell(p: float, position: int) -> tuple[int, int]:
        return min(DEPTHS - 1, (position + 1).bit_length() - 1), min(BINS - 1, max(0, int(p * BINS)))

    def accept(self, p: float, position: int = 0) -> float:
        """The chance that proposal `position` (0: the first) of probability p is accepted, once reached."""
        d, b = self._cell(p, position)
        return self.accepted[d][b] / self.reached[d][b]

    def chances(self, confidence: list[float]) -> list[float]:
        return [self.accept(p, i) for i, p in enumerate(confidence)]

    def add(self, p: float, accepted: bool, position: int = 0) -> None:
        d, b = self._cell(p, position)
        self.reached[d][b] += 1.0
        self.accepted[d][b] += 1.0 if accepted else 0.0

    def learn(self, confidence: list[float], proposal: list[int], committed: list[int]) -> None:
        """Every proposal the verify reached: accepted where it equals the committed token."""
        for i, p in enumerate(confidence[: len(proposal)]):
            if i >= len(committed):
                break
            self.add(p, proposal[i] == committed[i], i)
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
    line fitted to the verify times by length; and how many rows to draft (draft_length.py), where the draft
    graph drafts as many as it is handed."""

    def __init__(self, block_size: int, draft_rows: bool = True) -> None:
        """`draft_rows` False: every draft is of the whole block (benchmarks/verify_length_ab.py compares)."""
        from dflash_cli.decoding.draft_length import DraftLength
        from dflash_cli.decoding.hybrid import HybridStats

        self.calibration = Calibration()
        self.costs = HybridStats(block_size)
        self.draft = DraftLength(block_size) if draft_rows else None
        self.block = block_size

    def draft_rows(self) -> int:
        if self.draft is None:
            return self.block
        return self.draft.rows(self.costs.rate(), self.costs.verify_line())

    def drafted(self, confidence: list[float], seconds: float | None, context: int) -> None:
        if self.draft:
            self.draft.drafted_block(len(confidence) + 1, seconds, context)

    def length(self, confidence: list[float]) -> int:
        accept = self.calibration.chances(confidence)
        return choose_length(accept, self.costs.verify_line(), self.costs.rate())

    def learn(self, confidence: list[float], proposal: list[int], committed: list[int], verify_s: float, step_s: float):
        self.calibration.learn(confidence, proposal, committed)
        if self.draft:
            self.draft.verified(len(committed), len(proposal) + 1)
        self.costs.add_step(len(committed), step_s)
        if verify_s > 0:
            self.costs.add_verify(len(proposal) + 1, verify_s)
