"""The proposer each speculative mode decodes with, built from what the engine holds (and learns across requests)."""

from __future__ import annotations

from typing import Any

from dflash_cli.decoding.hybrid import HybridProposer
from dflash_cli.decoding.learnt import Learnt
from dflash_cli.decoding.loops import DFlashProposer, LookupProposer
from dflash_cli.decoding.proposer import Proposer
from dflash_cli.decoding.target_calls import TimedSession


def make_proposer(engine: Any, mode: str, learnt: Learnt, verify: str) -> Proposer:
    """`mode`: dflash, hybrid or lookup. `learnt`: the engine's Learnt, which keeps the hybrid's statistics and the
    DFlash verify budget, so later requests start from what earlier ones learnt. `verify`: run.verify."""
    if mode == "lookup":
        from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter

        return LookupProposer(PromptLookupDrafter(engine.block_size))
    engine.draft.reset()
    variable = engine.target.variable_length
    budget = learnt.budget(engine.block_size) if mode == "dflash" and verify == "auto" and variable else None
    draft = TimedSession(engine.draft)
    proposer = DFlashProposer(draft, engine.block_size, engine.mask_token_id, engine.prefill_len, budget)
    if mode == "hybrid":
        proposer = HybridProposer(proposer, engine.block_size, learnt.hybrid_stats, variable)
        learnt.hybrid_stats = proposer.stats
    return proposer
