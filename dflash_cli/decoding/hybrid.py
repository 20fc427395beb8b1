"""Hybrid drafting: per step, suffix lookup or the DFlash draft, whichever is worth its cost.

Text that copies earlier text (code edits, repeated structure, quoting the prompt) is drafted best
and for free by lookup; new text by the draft model. A draft step costs T_draft more than a lookup
step, so it is taken only when the extra tokens it is expected to get accepted would take longer
than that to produce at the rate decoding runs at right now:
    E[accepted by the draft | n] - E[accepted by lookup | n]  >  recent rate * T_draft
n is the length of the suffix that matched earlier text (lookup's evidence); "recent rate" is the
tokens per second of the last few steps (novel text runs slower than copied text, and the tokens
not drafted now are the next ones). Expectations and T_draft are learnt online on the engine.
Lookup's acceptance is learnt at every step, also when the draft proposed: its proposal is checked
against the tokens the target committed (a lower bound when it agreed with all of them). A lookup
step skips the draft call (its context queues for the draft's next call), so it costs one verify.
Greedy output stays the target's own whatever proposes: the target verifies every token.
"""

from __future__ import annotations

import time

from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter

MAX_NGRAM = 8  # longest suffix match counted as evidence; longer says little more
# Proposals come from the latest match of a suffix of at most this many tokens (prompt lookup's own
# setting): on HumanEval with the demo pair the latest 3-gram drafts better (tau 4.99) than the
# latest 8-gram match (4.83), while the longer match is the better evidence of how far a copy goes.
PROPOSAL_NGRAM = 3
PRIOR_WEIGHT = 2.0  # pseudo-steps behind each prior below, so a few real steps outweigh it
RECENT = 0.3  # weight of the newest step in the recent rate (an exponential average over ~3 steps)


class HybridStats:
    """Running means the hybrid decides by; kept on the engine, so later requests start informed."""

    def __init__(self, block_size: int) -> None:
        # Priors: lookup's acceptance grows with the matched length; the draft's is a middling guess.
        prior_lookup = [min(block_size, 1 + n) for n in range(MAX_NGRAM + 1)]
        self.lookup = [[PRIOR_WEIGHT * a, PRIOR_WEIGHT] for a in prior_lookup]  # per n: sum, count
        self.dflash = [[PRIOR_WEIGHT * (1 + block_size) / 2, PRIOR_WEIGHT] for _ in prior_lookup]
        self.t_draft = [0.0, 0]  # seconds, draft steps

    def expected_lookup(self, n: int) -> float:
        s, c = self.lookup[n]
        return s / c

    def expected_dflash(self, n: int) -> float:
        s, c = self.dflash[n]
        return s / c

    def draft_seconds(self) -> float | None:
        return self.t_draft[0] / self.t_draft[1] if self.t_draft[1] else None


class HybridProposer:
    mode = "hybrid"

    def __init__(self, dflash, block_size: int, stats: HybridStats | None = None) -> None:
        self.dflash = dflash
        self.draft = dflash.draft  # the loop times draft calls through this
        self.block = block_size
        self.lookup = PromptLookupDrafter(block_size, max_ngram=PROPOSAL_NGRAM)
        self.stats = stats or HybridStats(block_size)
        self.sources: list[str] = []  # per verify step: "dflash" or "lookup"
        self.rate: float | None = None  # recent tokens per second
        self._step: tuple[list[int], int, str, float] | None = None  # lookup proposal, n, source, start

    def start(self, prompt_features, last: int, pos: int) -> None:
        self.dflash.start(prompt_features, last, pos)

    def observe(self, features, first_pos: int) -> None:
        self.dflash.observe(features, first_pos)

    def use_lookup(self, n: int) -> bool:
        gain = self.stats.expected_dflash(n) - self.stats.expected_lookup(n)
        if gain <= 0:
            return True
        t_draft = self.stats.draft_seconds()
        if t_draft is None or self.rate is None:
            return False  # nothing measured yet: let the draft show what it does
        return gain <= self.rate * t_draft

    def propose(self, history: list[int], last: int, pos: int) -> list[int]:
        started = time.perf_counter()
        lookup, n = self.lookup.propose_and_evidence(history, MAX_NGRAM)
        if self.use_lookup(n):
            self.dflash.skip()
            source, proposal = "lookup", lookup
        else:
            before = (self.draft.calls, self.draft.seconds)
            proposal = self.dflash.propose(history, last, pos)
            if self.draft.calls > before[0]:  # a block drafted ahead at prefill cost nothing here
                self.stats.t_draft[0] += self.draft.seconds - before[1]
                self.stats.t_draft[1] += 1
            source = "dflash"
        self.sources.append(source)
        self._step = (lookup, n, source, started)
        return proposal

    def verified(self, committed: list[int]) -> None:
        """Learn from the target's verdict on this step (`committed`: the tokens it committed)."""
        lookup, n, source, started = self._step
        step_rate = len(committed) / max(time.perf_counter() - started, 1e-9)
        self.rate = step_rate if self.rate is None else RECENT * step_rate + (1 - RECENT) * self.rate
        c = len(committed)
        agree = next((i for i in range(c) if i >= len(lookup) or lookup[i] != committed[i]), c)
        # Exact when lookup proposed (or disagreed within what the target revealed), else a lower bound.
        lookup_accept = c if source == "lookup" else min(self.block, agree + 1)
        self.stats.lookup[n][0] += lookup_accept
        self.stats.lookup[n][1] += 1
        if source == "dflash":
            self.stats.dflash[n][0] += c
            self.stats.dflash[n][1] += 1
