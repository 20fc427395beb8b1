"""How many rows a DFlash step drafts: fewer where the proposals deep in a block are rarely reached.

A draft call costs more the more rows it carries: every row goes through every draft layer and the
full-vocabulary head, which at int4 on a CPU is compute bound (on the Qwen3-4B shape a 16-row draft costs
1.4x a plain step, so no verify length brought the break-even tau below 3.3). A draft handed fewer rows
proposes its first tokens about as well as the whole block's first ones (the rows attend to each other, and
the mask rows carry only their positions): on the demo pair, 30 HumanEval prompts, a 4-row draft committed
2.82 tokens per step against 2.71 for the first 4 rows of a 16-row one.

Each step drafts the D rows (the last committed token and D-1 proposals) worth the most:
    mean over recent whole-block drafts of  max_{L<=D} (E[committed | L] - rate * T_verify(L))  -  rate * T_draft(D)
that is, what the verify-length choice (verify_length.py) would have made of those blocks had they been cut
to D rows, less the draft's own cost; T_draft and T_verify are lines fitted to the timed calls (cost_line.py).
The verify length is then chosen from the drafted rows' own confidence, as before. Every EXPLORE-th step
drafts the whole block, which keeps those samples coming. Lossless either way: the target verifies every token
it commits.
"""

from __future__ import annotations

from collections import deque

from dflash_cli.decoding.cost_line import CostLine

EXPLORE = 8  # every this many steps, the whole block is drafted
SAMPLES = 32  # the whole-block drafts the choice is made from (about the last 256 steps)


class DraftLength:
    def __init__(self, block_size: int) -> None:
        self.block = block_size
        self.cost = CostLine(block_size)
        self.samples: deque[list[float]] = deque(maxlen=SAMPLES)  # confidences of recent whole-block drafts
        self.steps = 0
        self._choice: int | None = None  # made again after each new sample

    def rows(self, rate: float | None, verify_line, accept) -> int:
        """The rows to draft this step (2 .. block); `accept` maps a confidence to its calibrated chance of
        acceptance. The whole block until both costs and the rate are known."""
        self.steps += 1
        draft_line = self.cost.line()
        if rate is None or verify_line is None or draft_line is None or not self.samples or self.steps % EXPLORE == 0:
            return self.block
        if self._choice is None:
            self._choice = self._best(rate, verify_line, draft_line, accept)
        return self._choice

    def _best(self, rate: float, verify_line, draft_line, accept) -> int:
        from dflash_cli.decoding.verify_length import expected_committed

        worth = [0.0] * (self.block + 1)  # per D: summed over samples, the best verify of at most D rows
        verify = [rate * verify_line(length) for length in range(1, self.block + 1)]
        for confidence in self.samples:
            table = expected_committed([accept(p) for p in confidence])
            best = None
            for length in range(1, self.block + 1):
                value = table[length - 1] - verify[length - 1]
                best = value if best is None else max(best, value)
                worth[length] += best
        n = len(self.samples)
        values = {rows: worth[rows] / n - rate * draft_line(rows) for rows in range(2, self.block + 1)}
        return max(values, key=lambda rows: (values[rows], -rows))

    def learn(self, confidence: list[float], seconds: float | None) -> None:
        """One drafted block: its proposals' confidences, and the seconds it took (None: a call that also took in
        a prompt, whose time says nothing of a step's)."""
        rows = len(confidence) + 1
        if seconds is not None:
            self.cost.add(rows, seconds)
        if rows == self.block:
            self.samples.append(list(confidence))
            self._choice = None
