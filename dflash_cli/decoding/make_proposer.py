"""The proposer each speculative mode decodes with, built from what the engine holds (and learns across requests)."""

from __future__ import annotations

from typing import Any

from dflash_cli.decoding.hybrid import HybridProposer
from dflash_cli.decoding.loops import DFlashProposer, LookupProposer
from dflash_cli.decoding.proposer import Proposer
from dflash_cli.decoding.target_calls import TimedSession
from dflash_cli.decoding.verify_length import VerifyBudget


def make_proposer(engine: Any, mode: str) -> Proposer:
    """`mode`: dflash, hybrid or lookup. The engine keeps the hybrid's statistics and the DFlash verify budget,
    so later requests start from what earlier ones learnt."""
    if mode == "lookup":
        from dflash_cli.decoding.prompt_lookup import PromptLookupDrafter

        return LookupProposer(PromptLookupDrafter(engine.block_size))
    engine.draft.reset()
    variable = getattr(engine.target, "variable_length", False)
    budget = None
    if mode == "dflash" and engine.recipe.run.verify == "auto" and variable:
        engine.verify_budget = budget = engine.verify_budget or VerifyBudget(engine.block_size)
    draft = TimedSession(engine.draft)
    proposer = DFlashProposer(draft, engine.block_size, engine.mask_token_id, engine.prefill_len, budget)
    if mode == "hybrid":
        proposer = HybridProposer(proposer, engine.block_size, engine.hybrid_stats, variable)
        engine.hybrid_stats = proposer.stats
    return proposer
