"""How many rows a DFlash step drafts: fewer where the proposals deep in a block are rarely reached.

A draft call costs more the more rows it carries: every row goes through every draft layer and the
full-vocabulary head, which at int4 on a CPU is compute bound (on the Qwen3-4B shape a 16-row draft costs
1.4x a plain step, so no verify length brought the break-even tau below 3.3). A draft handed fewer rows
proposes its first tokens about as well as the whole block's first ones (the rows attend to each other, and
the mask rows carry only their positions): on the demo pair, 30 HumanEval prompts, a 4-row draft committed
2.82 tokens per step against 2.71 for the first 4 rows of a 16-row one.

Each step drafts the D rows (the last committed token and D-1 proposals) worth the most:
    E[min(A, D)] - rate * (T_draft(D) + T_verify(D))
where A is how many tokens a step commits when nothing cuts it short, estimated from every step seen (exact
where the target rejected a proposal, "at least" where the verify ended first: the hybrid's Kaplan-Meier table,
hybrid.py's Survival). T_verify is the line fitted to the timed verifies (cost_line.py); T_draft's cost per row
is fitted to the timed drafts together with the context rows each call also took in (the committed tokens of
the step before): a step after a long accepted run brings more context and tends to draft more rows, and a fit
on rows alone charged the demo pair's drafts several times their real cost per row. The verify length is then
chosen from the drafted rows' own confidence, as before. Every EXPLORE-th step drafts the whole block, so the
table keeps learning past D, and the choice is made again (once per EXPLORE steps: the bookkeeping of a choice
every step cost the demo pair 4% of its speed).

A first version weighed D by the draft's calibrated confidences (what the verify length is chosen by): on the
demo pair it cut drafts that the measured acceptance says were worth their rows (0.87x the speed of drafting
whole blocks); the acceptance counted from the steps themselves does not have that bias.
"""

from __future__ import annotations

import numpy as np

from dflash_cli.decoding.hybrid import Survival

EXPLORE = 8  # every this many steps, the whole block is drafted
MEMORY = 0.995  # per timed draft, the weight older ones keep in the cost fit


class DraftCost:
    """seconds = a + b * rows + c * context rows over the timed drafts, older ones decayed; `per_row` is b."""

    def __init__(self) -> None:
        self._sums = [0.0] * 9  # decayed: 1, r, c, r*r, r*c, c*c, t, r*t, c*t (plain floats: this runs every step)
        self.lengths: set[int] = set()

    def add(self, rows: int, context: int, seconds: float) -> None:
        r, c, t = float(rows), float(context), seconds
        sample = (1.0, r, c, r * r, r * c, c * c, t, r * t, c * t)
        self._sums = [MEMORY * old + new for old, new in zip(self._sums, sample)]
        self.lengths.add(rows)

    def per_row(self) -> float | None:
        """Seconds a further row costs (None before a timed draft). With one length timed, its mean time spread
        over its rows: shorter drafts look cheap, so they get tried (and the fit then tells)."""
        if not self.lengths:
            return None
        n, r, c, rr, rc, cc, t, rt, ct = self._sums
        if len(self.lengths) == 1:
            return t / n / next(iter(self.lengths))
        xx = np.array([[n, r, c], [r, rr, rc], [c, rc, cc]])
        coef = np.linalg.lstsq(xx + 1e-12 * np.eye(3), np.array([t, rt, ct]), rcond=None)[0]
        return max(0.0, float(coef[1]))


class DraftLength:
    def __init__(self, block_size: int) -> None:
        self.block = block_size
        self.cost = DraftCost()
        self.committed = Survival(block_size, block_size, prior_exact=False)  # "at least a block" until seen
        self.drafted = [0] * (block_size + 1)  # drafts per number of rows (what benchmarks report)
        self.steps = 0
        self._choice: int | None = None

    def rows(self, rate: float | None, verify_line) -> int:
        """The rows to draft this step (2 .. block). The whole block until both costs and the rate are known."""
        self.steps += 1
        if self.steps % EXPLORE == 0:
            self._choice = None
            return self.block
        if self._choice is None:
            self._choice = self._best(rate, verify_line)
        return self._choice or self.block

    def _best(self, rate: float | None, verify_line) -> int | None:
        per_row = self.cost.per_row()
        if rate is None or verify_line is None or per_row is None:
            return None  # asked again next step
        best, choice = None, self.block
        for rows in range(self.block, 1, -1):  # from the whole block down: a tie keeps more rows
            value = self.committed.expected(rows) - rate * (per_row * rows + verify_line(rows))
            if best is None or value > best + 1e-12:
                best, choice = value, rows
        return choice

    def drafted_block(self, rows: int, seconds: float | None, context: int) -> None:
        """A draft of `rows` rows took `seconds` (None: a call that also took in a prompt, whose time says nothing
        of a step's), with `context` context rows taken in alongside."""
        self.drafted[rows] += 1
        if seconds is not None:
            self.cost.add(rows, context, seconds)

    def verified(self, committed: int, length: int) -> None:
        """A verify of `length` tokens committed `committed`: exact where a proposal was rejected (or a whole
        block was taken), else "at least"."""
        self.committed.add(committed, exact=committed < length or length >= self.block)
