"""Prompt-lookup drafting (PLD; the "lookup" decoding mode): propose the tokens that followed the last
earlier copy of the suffix.

A model-free drafter, benchmarked beside DFlash as a cheap baseline: text that repeats itself
(code, quoting the prompt) is drafted for free. It runs once per decode step, so it is plain
Python over the committed ids with no allocations beyond the proposal.

Cost per call: for each n-gram size, one backward scan that stops at the first (latest) match,
so at most O(len(committed) * (max_ngram - min_ngram + 1)) comparisons of a single token before
the n-gram check — linear in the sequence length for the small fixed n used here.
"""

from __future__ import annotations


class PromptLookupDrafter:
    """Drafts `block_size - 1` tokens by n-gram lookup in the committed sequence (prompt + output)."""

    def __init__(self, block_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min={min_ngram} max={max_ngram}")
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    @property
    def num_proposals(self) -> int:
        # The first block slot holds the last committed token; the rest are proposals.
        return self.block_size - 1

    def propose(self, committed: list[int]) -> list[int]:
        """Exactly `block_size - 1` proposed ids for the positions after `committed`.

        Tries the longest suffix n-gram first (n = max_ngram .. min_ngram) and takes its latest
        earlier occurrence (the suffix itself excluded): recent context predicts best. The tokens
        that followed that occurrence are proposed. When they run into the end of `committed`, the
        text since the match is a repeating period, so the copy goes on through the proposal itself
        (a loop `a b a b` drafts `a b a b ...`, as far as the block reaches). With no match at all
        every slot repeats `committed[-1]`.
        """
        return self.propose_with_match(committed)[0]

    def propose_with_match(self, committed: list[int]) -> tuple[list[int], int]:
        """`propose`, plus the length of the suffix n-gram that matched (0: none) — the evidence a
        hybrid drafter weighs against the model's draft."""
        if not committed:
            raise ValueError("prompt lookup needs at least one committed token")
        want = self.num_proposals
        if want == 0:
            return [], 0
        found = self._match_end(committed)
        if found is None:
            return [committed[-1]] * want, 0
        follow, n = found
        # Copy from `follow` on; past the end of `committed` the copy reads its own output, which
        # continues the period (len(committed) - follow) of the repeated text.
        proposal: list[int] = []
        length = len(committed)
        for i in range(want):
            j = follow + i
            proposal.append(committed[j] if j < length else proposal[j - length])
        return proposal, n

    def propose_and_evidence(self, committed: list[int], evidence_max: int) -> tuple[list[int], int]:
        """`propose`'s proposal and the longest earlier match of the suffix (up to `evidence_max` tokens),
        in one backward pass over `committed` (a hybrid drafter asks this every step)."""
        if not committed:
            raise ValueError("prompt lookup needs at least one committed token")
        want, length, last = self.num_proposals, len(committed), committed[-1]
        cap = min(max(evidence_max, self.max_ngram), length - 1)
        top = min(self.max_ngram, length - 1)
        longest, latest = 0, {}  # latest: n -> last index of the latest match of the n-token suffix
        for end in range(length - 2, -1, -1):
            if committed[end] != last:
                continue
            m = 1
            while m < cap and end - m >= 0 and committed[end - m] == committed[length - 1 - m]:
                m += 1
            longest = max(longest, m)
            for n in range(self.min_ngram, min(m, top) + 1):
                latest.setdefault(n, end)
            if longest == cap and len(latest) == top - self.min_ngram + 1:
                break  # nothing earlier can match longer or later
        evidence = min(longest, evidence_max)
        if want == 0:
            return [], evidence
        if not latest:
            return [last] * want, evidence
        follow = latest[max(latest)] + 1
        proposal: list[int] = []
        for i in range(want):
            j = follow + i
            proposal.append(committed[j] if j < length else proposal[j - length])
        return proposal, evidence

    def _match_end(self, committed: list[int]) -> tuple[int, int] | None:
        """(index just after the best earlier match of a suffix n-gram, n), or None without one."""
        length = len(committed)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._latest_earlier_match(committed, n)
            if start is not None:
                return start + n, n
        return None

    @staticmethod
    def _latest_earlier_match(committed: list[int], n: int) -> int | None:
        """Start of the latest occurrence of the last `n` ids that ends before the suffix does."""
        length = len(committed)
        suffix = committed[length - n :]
        last = suffix[-1]
        # A match must be followed by at least one token, so it ends at length - 2 at the latest.
        # Scan on its last token first (one comparison per position), then check the whole n-gram.
        for end in range(length - 2, n - 2, -1):
            if committed[end] != last:
                continue
            start = end - n + 1
            if committed[start : end + 1] == suffix:
                return start
        return None
