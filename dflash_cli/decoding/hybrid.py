"""Hybrid drafting: per step, suffix lookup or the DFlash draft, and how many tokens to verify.

Text that copies earlier text (code edits, repeated structure, quoting the prompt) is drafted best
and for free by lookup; new text by the draft model. Each step picks the source s and the verify
length L (the last committed token plus L-1 proposed ones) that are worth the most time:
    E[committed | s, n, L]  -  rate * (T_verify(L) + T_draft if s is the draft)
n is the length of the suffix that matched earlier text (lookup's evidence); "rate" is the tokens
per second of hybrid decoding over the last few hundred steps, and never less than the cheapest step
earns (a lookup verify of 2 commits at least one token). Weighing time against tokens at the
long-run rate is what maximises tokens per second over a whole generation (where picking each step's
best ratio would not): a token a step does not commit costs, later, what tokens cost on average.
Measured on the demo pair (HumanEval, 164 prompts, paired per prompt against prompt lookup): with the
rate of the last ~3 steps instead, the draft was called after every slow stretch and the hybrid tied
lookup (0.99x [0.97, 1.01]); with the long-run rate, 1.00x-1.02x over three runs.
The verify length only varies where the target session takes calls of any length (ONNX Runtime's
prefix-cache graphs): a verify of 2 tokens costs ~0.7x one of 8 on the demo pair, and a step with no
lookup match rarely commits more than that; a lookup step inside a long copy verifies up to
LOOKUP_BLOCKS blocks at once (SuffixDecoding's adaptive speculation length: the longer the copy has
held, the more it is worth verifying). Static graphs (QAIC) always verify the whole block.
Everything is learnt online on the engine: per (source, n) how far proposals survive (a survival
table, so a short verify that was fully accepted counts as "at least L", not as "exactly L"), the
seconds of a verify per length and of a draft call. Lookup's acceptance is learnt at every step,
also when the draft proposed: its proposal is checked against the tokens the target committed.
A lookup step skips the draft call (its context queues for the draft's next call). Greedy output
stays the target's own whatever proposes: the target verifies every token.
"""

from __future__ import annotations

import time

from dflash_cli.decoding.cost_line import CostLine
from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter
from dflash_cli.decoding.proposer import Proposer
from dflash_cli.exporting.options import LOOKUP_BLOCKS  # how far a lookup step may verify

MAX_NGRAM = 8  # longest suffix match counted as evidence; longer says little more
# Proposals come from the latest match of a suffix of at most this many tokens (prompt lookup's own
# setting): on HumanEval with the demo pair the latest 3-gram drafts better (tau 4.99) than the
# latest 8-gram match (4.83), while the longer match is the better evidence of how far a copy goes.
PROPOSAL_NGRAM = 3
# Each length's hazard is shrunk towards the hazard pooled over lengths 2 and up by this many
# pseudo-steps: a length only a few steps reached (each seen only because a verify ran past it) would
# otherwise keep a hazard of 1 from a handful of stops and shut out, for good, the longer verifies that
# would show more. Measured on the demo pair: without it the hybrid stopped trying past 8 tokens after
# its first few long verifies (tau 4.54); with it, tau 6.3.
SHRINK = 8.0
PRIOR_WEIGHT = 2.0  # pseudo-steps behind each prior below, so a few real steps outweigh it
RATE_MEMORY = 0.995  # per step, the weight older steps keep in the rate (a memory of ~200 steps)


class Survival:
    """How many tokens a source's step commits (1..block), from steps seen exactly or only as "at least".

    A step's count A is exact when the target rejected a proposal (or the whole block was taken) and
    censored ("at least m") when the verify was shorter than the proposal could have run. The table
    keeps, per length k, how many steps reached k and how many stopped there (Kaplan-Meier).
    """

    def __init__(self, block: int, prior: int, prior_exact: bool = True) -> None:
        self.block = block
        self.reached = [0.0] * (block + 1)
        self.stopped = [0.0] * (block + 1)
        self._expected: list[float] | None = None  # per length, until the next `add`
        self.add(prior, exact=prior_exact, weight=PRIOR_WEIGHT)

    def add(self, count: int, exact: bool, weight: float = 1.0) -> None:
        self._expected = None
        count = max(1, min(count, self.block))
        for k in range(1, count):
            self.reached[k] += weight
        if exact and count < self.block:
            self.reached[count] += weight
            self.stopped[count] += weight

    def expected(self, length: int) -> float:
        """E[min(A, length)]: tokens a verify of `length` tokens is expected to commit."""
        if self._expected is None:
            # Past the longest step seen, the hazard pooled over lengths 2 and up: a copy that got going
            # stops at a roughly constant rate per token, so longer verifies than any tried get tried.
            seen = sum(self.reached[2:])
            tail = sum(self.stopped[2:]) / seen if seen else 0.5
            table, total, alive = [0.0], 0.0, 1.0
            for k in range(1, self.block + 1):
                total += alive
                table.append(total)
                # Shrunk towards the pooled hazard: a length few steps reached (a handful of stops, each
                # seen only because a verify ran past it) must not shut out the verifies that would show
                # more, as a hazard of 1 from three stops would, forever.
                shrink = SHRINK if k > 1 else 0.0  # the pooled hazard is over lengths 2 and up
                reached = self.reached[k] + shrink
                hazard = (self.stopped[k] + shrink * tail) / reached if reached else tail
                alive *= 1.0 - hazard
            self._expected = table
        return self._expected[min(length, self.block)]


class HybridStats:
    """What the hybrid decides by; kept on the engine, so later requests start informed."""

    def __init__(self, block_size: int, longest: int | None = None) -> None:
        self.block = block_size
        self.longest = max(longest or block_size, block_size)  # the longest verify a lookup step may take
        # Priors: lookup's steps commit more the longer the match; the draft's a middling guess.
        # A prior of a block or more says "at least a block", not where it stops: an exact prior past what
        # any verify reached would stop every step there forever (no real step would reach it to outweigh it).
        self.lookup = [Survival(self.longest, min(1 + n, block_size), 1 + n < block_size) for n in range(MAX_NGRAM + 1)]
        self.dflash = [Survival(block_size, (1 + block_size) // 2) for _ in range(MAX_NGRAM + 1)]
        self.t_draft = [0.0, 0]  # seconds, draft steps
        self.verify_cost = CostLine(self.longest)
        self.recent = [0.0, 0.0]  # tokens, seconds of hybrid steps, older ones decayed by RATE_MEMORY
        self.overhead = [0.0, 0.0]  # seconds of a step outside its draft and verify calls, steps (decayed likewise)

    def rate(self) -> float | None:
        """Tokens per second of hybrid decoding lately (None before the first step)."""
        tokens, seconds = self.recent
        return tokens / seconds if seconds > 0 else None

    def add_step(self, tokens: int, seconds: float, overhead: float = 0.0) -> None:
        self.recent = [RATE_MEMORY * self.recent[0] + tokens, RATE_MEMORY * self.recent[1] + seconds]
        self.overhead = [RATE_MEMORY * self.overhead[0] + overhead, RATE_MEMORY * self.overhead[1] + 1]

    def step_overhead(self) -> float:
        return self.overhead[0] / self.overhead[1] if self.overhead[1] else 0.0

    def expected_lookup(self, n: int, length: int | None = None) -> float:
        return self.lookup[n].expected(length or self.block)

    def expected_dflash(self, n: int, length: int | None = None) -> float:
        return self.dflash[n].expected(length or self.block)

    def draft_seconds(self) -> float | None:
        return self.t_draft[0] / self.t_draft[1] if self.t_draft[1] else None

    def verify_seconds(self, length: int) -> float | None:
        line = self.verify_line()
        return None if line is None else line(length)

    def verify_line(self):
        """Seconds of a verify as a function of its length (None before any verify was timed): cost_line.py."""
        return self.verify_cost.line()

    def add_verify(self, length: int, seconds: float) -> None:
        self.verify_cost.add(length, seconds)


class HybridProposer(Proposer):
    """Per step, lookup's proposal or the DFlash draft's (`dflash`: a loops.DFlashProposer)."""

    mode = "hybrid"

    def __init__(self, dflash, block_size: int, stats: HybridStats | None = None, variable_length: bool = False):
        self.dflash = dflash
        self.draft = dflash.draft  # the loop times draft calls through this
        self.block = block_size
        self.stats = stats or HybridStats(block_size, LOOKUP_BLOCKS * block_size if variable_length else None)
        # The longest verify a step may take (the loop caps `limit` by it): static graphs verify the block.
        self.longest = self.stats.longest if variable_length else block_size
        self.variable = variable_length
        self.lookup = PromptLookupDrafter(self.longest, max_ngram=PROPOSAL_NGRAM)
        self.sources: list[str] = []  # per verify step: "dflash" or "lookup"
        # lookup proposal, n, source, L, start, draft seconds
        self._step: tuple[list[int], int, str, int, float, float] | None = None

    def start(self, prompt_features, last: int, pos: int) -> None:
        self.dflash.start(prompt_features, last, pos)

    def observe(self, features, first_pos: int) -> None:
        self.dflash.observe(features, first_pos)

    def choose(self, n: int, limit: int | None = None) -> tuple[str, int]:
        """(source, verify length) for a step whose suffix matched `n` earlier tokens; `limit` caps the
        length (the tokens the generation still needs, where that is more than a block)."""
        st, full = self.stats, self.block
        longest = min(self.longest, max(limit or self.longest, full))
        rate = st.rate()
        if rate is None:
            # Nothing measured yet: let the draft show what it does unless lookup looks at least as good.
            return ("lookup" if st.expected_lookup(n, full) >= st.expected_dflash(n) else "dflash"), full
        t_draft = st.draft_seconds() or 0.0  # an untimed draft counts as free, so it gets tried where it looks better
        line = st.verify_line()
        rate = max(rate, self._rate_floor(line))
        # Batched serving: a verify's extra rows delay every sequence sharing the call, so its cost is charged at
        # their total rate. The draft's time is the whole batched call, of which this sequence's own rows are
        # about 1/sharing: charged at its own rate, that is the same. Measured with 4 clients at the 4B shape's
        # int4 costs (benchmarks/results/serve-batching/demo-at-4b-int4-costs*): 1.08-1.10x the total tok/s of
        # charging the own rate. The same rule for DFlash's verify lengths (verify_length.py) gave 0.95-1.00x.
        sharing = self.sharing()
        best, choice = None, ("lookup", full)
        for length in range(2, longest + 1) if self.variable else (full,):
            t_verify = line(length) if line else None
            if t_verify is None and length != full:
                continue  # no verify timed yet: the whole block, where only the draft's cost tells them apart
            t_verify = t_verify or 0.0
            options = [("lookup", st.expected_lookup(n, length), 0.0)]
            if length <= full:  # the draft proposes one block
                options.append(("dflash", st.expected_dflash(n, length), t_draft))
            for source, expected, extra in options:
                value = expected - rate * (sharing * t_verify + extra)
                if best is None or value > best + 1e-12:
                    best, choice = value, (source, length)
        return choice

    def _rate_floor(self, line) -> float:
        """The long-run rate is at least what the cheapest step earns: a lookup verify of the shortest length, no
        draft, commits one token or more. Without this floor dear steps lower the loop's own rate, which makes
        time look cheap, which picks dear steps again: on the gpt-oss-20b shape at int4 (a 16-token verify ~8x a
        one-token call) a cold hybrid verified whole blocks of a draft that committed nothing, at 0.2x plain."""
        if not line:
            return 0.0
        cheapest = line(2 if self.variable else self.block) + self.stats.step_overhead()
        return 1.0 / cheapest if cheapest > 0 else 0.0

    def propose(self, history: list[int], last: int, pos: int, limit: int) -> list[int]:
        started = time.perf_counter()
        lookup, n = self.lookup.propose_and_evidence(history, MAX_NGRAM)
        source, length = self.choose(n, limit)
        drafted = 0.0
        if source == "lookup":
            self.dflash.skip()
            proposal = lookup
        else:
            before = (self.draft.calls, self.draft.seconds)
            proposal = self.dflash.propose(history, last, pos, self.block)
            if self.draft.calls > before[0]:  # a block drafted ahead at prefill cost nothing here
                drafted = self.draft.seconds - before[1]
                self.stats.t_draft[0] += drafted
                self.stats.t_draft[1] += 1
        self.sources.append(source)
        self._step = (lookup, n, source, length, started, drafted)
        return proposal[: length - 1]

    def verified(self, committed: list[int], verify_s: float) -> None:
        """Learn from the target's verdict on this step (`committed`: the tokens it committed)."""
        lookup, n, source, length, started, drafted = self._step
        c = len(committed)
        seconds = time.perf_counter() - started
        self.stats.add_step(c, seconds, max(0.0, seconds - verify_s - drafted))
        if verify_s > 0:
            self.stats.add_verify(length, verify_s)
        # The proposer's own count is exact unless the verify ended before a proposal was rejected.
        own = self.stats.lookup[n] if source == "lookup" else self.stats.dflash[n]
        own.add(c, exact=c < length or length >= own.block)
        if source == "dflash":
            # Lookup's proposal checked against what the target committed: exact where it disagreed.
            agree = next((i for i in range(c) if i >= len(lookup) or lookup[i] != committed[i]), c)
            self.stats.lookup[n].add(agree + 1, exact=agree < c or agree + 1 >= self.stats.longest)
