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

The draft's own head pays per proposal too (each row through a 151936-row lm_head: at int4 on the 4B shape a
draft call of 15 proposals costs ~1.4x a plain step), so a draft graph that takes `proposal_rows` is asked
for a few more proposals than recent steps chose to verify, and twice as many after a step that verified all
it was given. A head row costs about a tenth of a verify row, hence the generous margin.
"""

from __future__ import annotations

from collections import deque

BINS = 10  # equal-width bins of the draft's probability
# Under load a request that stopped drafting still drafts every EXPLORE-th step, so what a draft costs and
# yields stays current (the load drops, the acceptance changes with the text).
EXPLORE = 8
DRAFTED_MEMORY = 0.98  # per drafted step, the weight older ones keep in what drafting yields and costs
PRIOR_WEIGHT = 4.0  # pseudo-proposals per bin behind the prior "accepted at the draft's own probability"
HEAD_WINDOW = 8  # drafted steps whose verify choices bound the next draft's proposals
HEAD_MARGIN = 2  # proposals asked for beyond the most any of those steps verified


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
    """What a DFlash loop decides its verify lengths by; kept in the engine's Learnt (decoding/learnt.py), so
    later requests start informed: the calibration, and (the hybrid's own bookkeeping, decoding/hybrid.py) the
    loop's long-run rate and a line fitted to the verify times by length."""

    def __init__(self, block_size: int) -> None:
        from dflash_cli.decoding.hybrid import HybridStats

        self.calibration = Calibration()
        self.costs = HybridStats(block_size)
        self.drafted = [0.0, 0.0, 0.0, 0.0]  # decayed: drafted steps, tokens they committed, rows verified, draft s
        self._skipped = 0  # steps since the last draft
        self._wanted: deque[int] = deque(maxlen=HEAD_WINDOW)  # proposals each recent drafted step could use

    def proposal_rows(self, most: int) -> int:
        """How many of a block's `most` proposals to ask the draft for: all of them until the verify's costs are
        known (as `length`), then HEAD_MARGIN more than recent steps could use."""
        if self.costs.rate() is None or self.costs.verify_line() is None or not self._wanted:
            return most
        return max(1, min(most, max(self._wanted) + HEAD_MARGIN))

    def length(self, confidence: list[float]) -> int:
        accept = [self.calibration.accept(p) for p in confidence]
        return choose_length(accept, self.costs.verify_line(), self.costs.rate())

    def draft_pays(self, sharing: int) -> bool:
        """Whether this step drafts at all. Alone, always: that is what DFlash mode was asked for. In batched
        serving (`sharing` sequences decoding at once), only while the tokens a drafted step commits beyond a
        plain step's one are worth the draft's time and its longer verify, the verify's rows charged at the rate
        of every sequence sharing the call (decoding/hybrid.py's rule): on compute-bound calls a loaded server
        decodes faster without drafts, as vLLM's dynamic speculation turns speculation off as the batch grows."""
        steps, tokens, rows, draft_s = self.drafted
        rate, line = self.costs.rate(), self.costs.verify_line()
        if sharing <= 1 or steps <= 0 or rate is None or line is None or self._skipped >= EXPLORE - 1:
            self._skipped = 0
            return True
        cost = rate * (sharing * (line(rows / steps) - line(1)) + draft_s / steps)
        if tokens / steps - 1.0 > cost:
            self._skipped = 0
            return True
        self._skipped += 1
        return False

    def learn(
        self,
        confidence: list[float],
        proposal: list[int],
        committed: list[int],
        verify_s: float,
        step_s: float,
        draft_s: float | None = None,
    ):
        """A drafted step (`draft_s`: its draft call's seconds, None when its block was drafted ahead), or, with
        `confidence` None, a step that did not draft."""
        if confidence is not None:
            self.calibration.learn(confidence, proposal, committed)
            # it verified every proposal it was given: it might have used more
            self._wanted.append(2 * len(proposal) if len(proposal) >= len(confidence) else len(proposal))
        if draft_s is not None:
            old = [DRAFTED_MEMORY * v for v in self.drafted]
            self.drafted = [a + b for a, b in zip(old, (1.0, len(committed), len(proposal) + 1, draft_s))]
        self.costs.add_step(len(committed), step_s)
        if verify_s > 0:
            self.costs.add_verify(len(proposal) + 1, verify_s)
