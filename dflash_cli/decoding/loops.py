"""The plain baseline loop and the speculative loop (DFlash draft or prompt lookup), REFERENCE 1.

Per speculative step: draft a block [last, MASK...] at positions p..p+B-1, verify it with one
target call, accept the longest matching prefix plus the target's own token, and hand the
committed positions' context features to the draft. Rollback is implicit: both caches mask by
position, so the next block simply overwrites the rejected slots. Whoever proposes (the DFlash draft,
prompt lookup, the hybrid of both) answers the loop through decoding/proposer.py's Proposer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dflash_cli.backends.base import proposal_rows
from dflash_cli.decoding.constraint import Constraint
from dflash_cli.decoding.logprobs import TokenLogprob, entry, prompt_entries
from dflash_cli.decoding.penalty import RepetitionPenalty
from dflash_cli.decoding.proposer import Proposer
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.decoding.sampling import Sampler, SamplingConfig
from dflash_cli.decoding.target_calls import TimedSession, padded, prefill
from dflash_cli.decoding.verify_length import VerifyBudget
from dflash_cli.exporting.names import PROPOSAL_ROWS

if TYPE_CHECKING:
    from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter


@dataclass(frozen=True)
class LoopConfig:
    max_new_tokens: int
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    sampling: SamplingConfig = SamplingConfig()
    logprobs: int | None = None  # each committed token's logprob and this many alternatives (None: none)
    prompt_logprobs: bool = False  # also each prompt token's, from the prefill's logits
    # The list the entries are appended to as tokens are committed (before on_commit sees them), where a caller
    # streams them; None: a list of the loop's own. Either way the result carries it.
    logprobs_out: list | None = None
    # Picks each token from its logits row, position by position: a grammar the output follows
    # (decoding/constraint.py), a repetition penalty (decoding/penalty.py, over a grammar where both are asked)
    constraint: Constraint | RepetitionPenalty | None = None


def _pick(sampler: Sampler, cfg: LoopConfig, row: np.ndarray | None, greedy_token: int) -> int:
    """The target's token at one position: the sampler's pick, under the grammar where there is one."""
    if cfg.constraint is not None:
        return cfg.constraint.pick(row, sampler)
    return sampler.pick(row, greedy_token)


class _Output:
    """Committed tokens with stop/length handling; `done` once either triggers.

    `on_commit` receives each step's committed tokens; returning a non-empty string (e.g. "stop_string",
    "cancelled") ends generation with that reason after the current step, which is how a caller
    stops on text or abandons a request without waiting for max_new_tokens.
    """

    def __init__(self, cfg: LoopConfig, on_commit: Callable[[list[int]], str | None] | None) -> None:
        self.cfg, self.tokens, self.stopped, self._on_commit = cfg, [], "", on_commit
        self.logprobs: list[TokenLogprob] | None = None
        if cfg.logprobs is not None:
            self.logprobs = cfg.logprobs_out if cfg.logprobs_out is not None else []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def prompt(self, prefilled: dict[str, np.ndarray], prompt: list[int]) -> None:
        """The prompt's logprobs, where asked, from the prefill's outputs (every prompt row's logits)."""
        if self.cfg.prompt_logprobs:
            self.prompt_logprobs = prompt_entries(prefilled["logits"], prompt, self.cfg.logprobs or 0)

    def commit(self, new: list[int], rows: list[np.ndarray | None] | None = None) -> None:
        """`rows`: the logits row each token was chosen from (needed where logprobs are asked for)."""
        taken = []
        for i, t in enumerate(new):
            if len(self.tokens) >= self.cfg.max_new_tokens:
                self.stopped = "length"
                break
            self.tokens.append(t)
            taken.append(t)
            if self.logprobs is not None:
                self.logprobs.append(entry(rows[i], t, self.cfg.logprobs))
            if t in self.cfg.stop_ids:
                self.stopped = "stop_token"
                break
        if len(self.tokens) >= self.cfg.max_new_tokens and not self.stopped:
            self.stopped = "length"
        if taken and self._on_commit:
            reason = self._on_commit(taken)
            if reason and not self.stopped:
                self.stopped = reason

    @property
    def done(self) -> bool:
        return bool(self.stopped)


def generate_plain(
    target: TimedSession, prompt: list[int], prefill_len: int, cfg: LoopConfig, on_commit=None
) -> GenerationResult:
    sampler = Sampler(cfg.sampling)
    out = _Output(cfg, on_commit)
    t0 = time.perf_counter()
    res = prefill(target, prompt, prefill_len)
    out.prompt(res, prompt)
    row = res.get("logits", [None])[-1]
    out.commit([_pick(sampler, cfg, row, res["tokens"][-1])], [row])
    t1 = time.perf_counter()
    target.reset_counters()
    pos = len(prompt)
    while not out.done:
        ids, p = padded([out.tokens[-1]], pos, 1)
        step = target.run({"input_ids": ids, "position_ids": p})
        row = step.get("logits", [[None]])[0][0]
        out.commit([_pick(sampler, cfg, row, step["tokens"][0, 0])], [row])
        pos += 1
    t2 = time.perf_counter()
    return GenerationResult(
        mode="plain",
        prompt_tokens=len(prompt),
        tokens=out.tokens,
        accept_lengths=[1] * max(0, len(out.tokens) - 1),
        block_size=1,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        target_calls=target.calls,
        target_s=target.seconds,
        stopped=out.stopped,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
    )


class DFlashProposer(Proposer):
    """Draft-model proposals: feeds committed context features, returns B-1 draft tokens."""

    mode = "dflash"

    def __init__(
        self, draft: TimedSession, block_size: int, mask_id: int, prefill_len: int, verify: VerifyBudget | None = None
    ) -> None:
        self.draft, self.block, self.mask_id, self.prefill_len = draft, block_size, mask_id, prefill_len
        self.longest = block_size  # the draft proposes one block
        # Where set (a target that takes calls of any length): verify only as far as the draft's confidence
        # makes worth the call (decoding/verify_length.py); None: always the whole block.
        self.verify = verify
        self._confidence: list[float] | None = None  # of the block drafted last, if the draft graph gives it
        # this step's proposal, start and draft seconds (None: drafted ahead), for `verified`; proposal None: no draft
        self._step: tuple[list[int] | None, float, float | None] | None = None

    def start(self, prompt_features: np.ndarray, last: int, pos: int) -> None:
        """Ingest the prompt's context (prefill work, so it counts toward time to first token) and
        draft the first block right away."""
        self._pending = [(prompt_features, 0)]  # context not yet in the draft cache: (features, first position)
        self._ready = self._draft(last, pos)

    def observe(self, features: np.ndarray, first_pos: int) -> None:
        # Queued, not sent: steps another drafter proposed add their context here, and the next
        # draft call catches the draft cache up in one go.
        self._pending.append((features, first_pos))

    def propose(self, history: list[int], last: int, pos: int, limit: int) -> list[int]:
        started = time.perf_counter()
        ready, self._ready = self._ready, None
        if ready is None and self.verify is not None and not self.verify.draft_pays(self.sharing()):
            self._step = (None, started, None)  # a plain step; its context queues for the next draft call
            return []
        before = self.draft.seconds
        proposal = ready if ready is not None else self._draft(last, pos)
        if self.verify is not None and self._confidence is not None:
            proposal = proposal[: self.verify.length(self._confidence[: limit - 1]) - 1]
            self._step = (proposal, started, None if ready is not None else self.draft.seconds - before)
        return proposal

    def verified(self, committed: list[int], verify_s: float) -> None:
        if self._step is None:
            return
        proposal, started, draft_s = self._step
        self._step = None
        step_s = time.perf_counter() - started
        if proposal is None:
            self.verify.learn(None, [], committed, verify_s, step_s)
        else:
            self.verify.learn(self._confidence, proposal, committed, verify_s, step_s, draft_s)

    def skip(self) -> None:
        """Another drafter proposes this step: a block drafted ahead is stale."""
        self._ready = None

    def _rows(self, final: bool) -> dict[str, np.ndarray]:
        """The `proposal_rows` feed where the draft graph takes it: a call that only fills the cache needs one
        proposal; a final call as many as the verify budget may use (all without one)."""
        if PROPOSAL_ROWS not in getattr(self.draft.session, "input_names", ()):
            return {}
        most = self.block - 1
        n = 1 if not final else most if self.verify is None else self.verify.proposal_rows(most)
        return {PROPOSAL_ROWS: proposal_rows(n)}

    def _draft(self, last: int, pos: int) -> list[int]:
        block = [last] + [self.mask_id] * (self.block - 1)
        ids, bpos = padded(block, pos, self.block)
        result = None
        if len(self._pending) > 1:  # consecutive positions: one array, sent in as few calls as fit
            self._pending = [(np.concatenate([f for f, _ in self._pending]), self._pending[0][1])]
        variable = self.draft.session.variable_length
        for feats, first in self._pending:
            # Fixed shapes: after prefill the context comes in prefill-sized chunks; after a verify it fits
            # one block. A session of variable length takes it all in one call (after a run of lookup steps
            # one call over 256 positions costs what two 64-position calls do), padded to a block at least:
            # the draft's prefix graph cannot take a call whose context and cache hold fewer than a block.
            if variable:
                chunk = max(len(feats), self.block)
            else:
                chunk = self.prefill_len if len(feats) > self.block else self.block
            for s in range(0, len(feats), chunk):
                part = feats[s : s + chunk]
                width = max(len(part), self.block) if variable else chunk
                ctx = np.zeros((1, width, part.shape[-1]), dtype=part.dtype)
                ctx[0, : len(part)] = part
                _, cpos = padded([0] * len(part), first + s, width)
                # A call before the last only fills the cache (its block is drafted again): its block sits right
                # after its context, so it sees no slot a later call has yet to write (on an accelerator those
                # hold whatever the buffer held, NaN in the fp16 check, and its outputs would be NaN).
                final = s + chunk >= len(feats)
                block_pos = bpos if final else padded(block, first + s + len(part), self.block)[1]
                feeds = {"input_ids": ids, "position_ids": block_pos, "context_features": ctx}
                result = self.draft.run({**feeds, "context_position_ids": cpos, **self._rows(final)})
        self._pending = []
        confidence = result.get("draft_confidence")  # absent from graphs exported before revision 10
        self._confidence = None if confidence is None else [float(p) for p in confidence[0]]
        return [int(t) for t in result["draft_tokens"][0]]


class LookupProposer(Proposer):
    """Prompt-lookup proposals through the same verify path (no model: no draft, no hooks)."""

    mode = "lookup"

    def __init__(self, drafter: PromptLookupDrafter) -> None:
        self.drafter = drafter
        self.longest = drafter.block_size

    def propose(self, history: list[int], last: int, pos: int, limit: int) -> list[int]:
        return list(self.drafter.propose(history))


def generate_speculative(
    target: TimedSession,
    proposer: Proposer,
    prompt: list[int],
    prefill_len: int,
    block: int,
    cfg: LoopConfig,
    on_commit=None,
) -> GenerationResult:
    sampler = Sampler(cfg.sampling)
    out = _Output(cfg, on_commit)
    draft_timer = proposer.draft
    t0 = time.perf_counter()
    res = prefill(target, prompt, prefill_len)
    out.prompt(res, prompt)
    row = res.get("logits", [None])[-1]
    out.commit([_pick(sampler, cfg, row, res["tokens"][-1])], [row])
    pos, accepts, verify_lengths = len(prompt), [], []
    proposer.start(res["context_features"], out.tokens[-1], pos)
    t1 = time.perf_counter()
    target.reset_counters()
    if draft_timer:
        draft_timer.reset_counters()
    # A session that takes calls of any length verifies only what was proposed; a static graph
    # verifies the whole block with padding (position -1) after a shorter proposal.
    variable = target.session.variable_length
    # A proposer that may verify past the block (the hybrid's lookup steps, on such a session) is held to
    # the tokens the generation still needs: the engine's room for prompt + new tokens + one block then
    # also bounds every longer verify. Every other step's limit is the block.
    longest = max(block, proposer.longest) if variable else block
    while not out.done:
        last = out.tokens[-1]
        limit = min(longest, max(block, cfg.max_new_tokens - len(out.tokens)))
        proposal = proposer.propose(prompt + out.tokens, last, pos, limit)[: limit - 1]
        if cfg.constraint is not None:  # forced tokens in, forbidden ones out (decoding/constraint.py)
            proposal = cfg.constraint.cut(proposal, limit - 1)
        length = len(proposal) + 1
        ids, bpos = padded([last, *proposal], pos, length if variable else block)
        before = target.seconds
        ver = target.run({"input_ids": ids, "position_ids": bpos})
        logits = ver.get("logits")
        committed, rows = [], []
        for i in range(length):
            rows.append(None if logits is None else logits[0, i])
            y = _pick(sampler, cfg, rows[-1], ver["tokens"][0, i])
            committed.append(y)
            if i == length - 1 or proposal[i] != y:
                break
        accepts.append(len(committed))
        verify_lengths.append(length)
        proposer.verified(committed, target.seconds - before)
        proposer.observe(ver["context_features"][0, : len(committed)], pos)
        out.commit(committed, rows)
        pos += len(committed)
    t2 = time.perf_counter()
    return GenerationResult(
        mode=proposer.mode,
        prompt_tokens=len(prompt),
        tokens=out.tokens,
        accept_lengths=accepts,
        block_size=block,
        prefill_s=t1 - t0,
        decode_s=t2 - t1,
        target_calls=target.calls,
        target_s=target.seconds,
        draft_calls=draft_timer.calls if draft_timer else 0,
        draft_s=draft_timer.seconds if draft_timer else 0.0,
        step_sources=list(proposer.sources),
        verify_lengths=verify_lengths,
        stopped=out.stopped,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
    )
