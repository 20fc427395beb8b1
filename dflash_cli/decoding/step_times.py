"""What each kind of call costs, warm: the decomposition `dflash bench` reports beside a measured speedup."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from dflash_cli.backends.base import proposal_rows
from dflash_cli.decoding.target_calls import padded
from dflash_cli.exporting.names import PROPOSAL_ROWS

TIMING_POSITION = 64  # where timing calls write; any position past the context works


def step_times(target, draft, block_size: int, hidden_size: int, repeats: int = 20) -> dict[str, Any]:
    """Median seconds of one plain step, one verify call and one draft call, and of target calls of 2, 4, 8...
    tokens below the block (`t_verify_curve`: how verify cost grows; a mixture-of-experts target reads more
    experts the more tokens a call has); `t_draft_curve` likewise for draft calls of fewer rows, where the draft
    graph takes them (what a smaller dflash.block_size costs); `t_draft_proposals_curve` for n: a whole-block
    draft asking for n - 1 proposals (graph revision 15: what `run.verify: auto` pays before a verify of n)."""
    B, H = block_size, hidden_size
    target.reset()
    draft.reset()
    one, block = _block_feeds(1), _block_feeds(B)
    _, cpos = padded([0] * B, TIMING_POSITION - B, B)
    draft_feeds = {**block, "context_features": np.zeros((1, B, H), np.float32), "context_position_ids": cpos}
    times: dict[str, Any] = {
        "t1": median_seconds(lambda: target.run(one), repeats),
        "t_verify": median_seconds(lambda: target.run(block), repeats),
        "t_draft": median_seconds(lambda: draft.run(draft_feeds), repeats),
    }
    shorter = tuple(n for n in (2, 4, 8, 16, 32) if n < B)
    curve = verify_cost_curve(target, shorter, repeats) if shorter else {}
    times["t_verify_curve"] = {1: times["t1"], **curve, B: times["t_verify"]}
    drafts = {}
    if getattr(draft, "any_block_rows", False):
        shorten = lambda n: {k: v[:, :n] if k in block else v for k, v in draft_feeds.items()}  # noqa: E731
        drafts["t_draft_curve"] = {n: shorten(n) for n in shorter}
    if PROPOSAL_ROWS in getattr(draft, "input_names", ()):
        drafts["t_draft_proposals_curve"] = {n: {**draft_feeds, PROPOSAL_ROWS: proposal_rows(n - 1)} for n in shorter}
    for name, calls in drafts.items():
        measured = {n: median_seconds(lambda: draft.run(f), repeats) for n, f in calls.items()}  # noqa: B023
        times[name] = {**measured, B: times["t_draft"]} if measured else None
    return times


def verify_cost_curve(target, sizes: tuple[int, ...] = (1, 2, 4, 8, 16), repeats: int = 20) -> dict[int, float]:
    """Median target-call seconds for each number of tokens (how verify cost grows with the block)."""
    out = {}
    for n in sizes:
        feeds = _block_feeds(n)
        out[n] = median_seconds(lambda: target.run(feeds), repeats)  # noqa: B023 - called before the next n
    return out


def _block_feeds(n: int) -> dict[str, np.ndarray]:
    return dict(zip(("input_ids", "position_ids"), padded([1] * n, TIMING_POSITION, n)))


def median_seconds(call, repeats: int) -> float:
    """Median wall time of `call` after one warm-up call."""
    call()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)
