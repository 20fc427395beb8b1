"""What the proposers learn across requests on one engine, in one declared place.

The engine owns a `Learnt` and hands it to `make_proposer` for every request, so a later request starts
from what earlier ones measured (the DFlash verify budget's calibration, the hybrid's rates and curves)
instead of from scratch. Each part is made on first use: a mode that never runs learns nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dflash_cli.decoding.hybrid import HybridStats
from dflash_cli.decoding.verify_length import VerifyBudget


@dataclass
class Learnt:
    verify_budget: VerifyBudget | None = None  # what DFlash steps have learnt of verify lengths
    hybrid_stats: HybridStats | None = None  # what hybrid steps have learnt of both proposers

    def budget(self, block_size: int) -> VerifyBudget:
        if self.verify_budget is None:
            self.verify_budget = VerifyBudget(block_size)
        return self.verify_budget

    def copy(self) -> Learnt:
        """Another holder of the parts learnt so far (shared: they go on learning together); a part not yet
        made is made apart in each. What a copied engine (Engine.with_own_tokenizer) has always had."""
        return replace(self)
