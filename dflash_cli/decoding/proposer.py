"""What the speculative loop (loops.generate_speculative) asks of whoever proposes the draft tokens.

Each step the loop asks `propose` for tokens to follow the last committed one, verifies them with one
target call, commits the longest matching prefix plus the target's own token, then reports back
through `verified` and `observe`. The target verifies every token, so greedy output is the target's
own whatever a proposer returns: a bad proposal costs time, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from dflash_cli.decoding.target_calls import TimedSession


@runtime_checkable
class Proposer(Protocol):
    """A draft-token proposer. Subclass it explicitly: the optional members below then have their defaults.

    Required:
      mode      the decoding mode's name (decoding/modes.py), reported as GenerationResult.mode.
      longest   the longest verify (last token + proposals) a step may take. The block size, except for a
                proposer that may verify past it where the target takes calls of any length (the hybrid's
                lookup steps). On a static target graph the loop verifies one block whatever this says.
      propose   see its docstring.

    Optional (defaults here):
      draft     the draft model's timed session, whose calls and seconds the result reports; None
                (default) for a proposer without a model.
      sources   per verify step, who proposed it ("dflash" / "lookup"); empty (default) for a proposer
                with one source. Read once, after the generation.
      start, verified, observe   hooks, no-ops by default: see their docstrings.
    """

    mode: str
    longest: int
    draft: TimedSession | None = None
    sources: Sequence[str] = ()

    def sharing(self) -> int:
        """The sequences whose calls this one's draft calls share in batched serving (batching.SlotSession): a
        second added to a call costs their total rate. 1 outside batched serving."""
        return getattr(getattr(self.draft, "session", None), "sharing", 1)

    def propose(self, history: list[int], last: int, pos: int, limit: int) -> list[int]:
        """Tokens to verify after `last` (the newest committed token, at position `pos`; `history` is the
        prompt plus every committed token). `limit` is this step's longest verify: the loop uses at most
        `limit - 1` tokens. It is the block size unless `longest` exceeds it, then also capped by the
        tokens the generation still needs (never below a block)."""
        ...

    def start(self, prompt_features: np.ndarray, last: int, pos: int) -> None:
        """After prefill (its time counts toward time to first token): the prompt's context features, the
        first generated token and its position."""

    def verified(self, committed: list[int], verify_s: float) -> None:
        """The target's verdict on the step just proposed: the tokens it committed, and the seconds of the
        verify call (for a proposer that weighs cost)."""

    def observe(self, features: np.ndarray, first_pos: int) -> None:
        """Context features of the tokens just committed, the first of them at `first_pos`."""
