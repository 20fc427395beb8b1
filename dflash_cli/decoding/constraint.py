"""Structured output: a grammar (JSON schema, regex, choice, Lark) the answer must follow, as a token mask
per position (llguidance).

The decoding loops pick every committed token from its logits row with the tokens the grammar forbids taken
out, and advance the grammar by the token picked, position by position through a verify block: a row after a
rejected proposal is never read, so the grammar's state is always that of the committed text and a verify
block picks exactly what one-token calls would (constrained DFlash == constrained plain, token for token;
with a seed, the same sampled text). A proposal is cut at its first token the grammar forbids, which the
target could not have accepted, so it costs no verify row; where the grammar forces the next tokens, they are
proposed whatever the draft guessed. Masks need the logits (export.logits=true).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_cli.errors import GenerationError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ConstraintSpec:
    """What the answer must follow: `kind` in KINDS and its value (a schema dict, a regex, a list of strings, a
    Lark grammar; json_object takes none)."""

    kind: str
    value: Any = None

    def grammar(self) -> str:
        """llguidance's grammar text for this spec."""
        from llguidance import LLMatcher

        # JSON without whitespace between its tokens (a schema's own "x-guidance" may say otherwise): left free, a
        # model can spend every token on whitespace before the first key.
        compact = {"whitespace_flexible": False}
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.value, defaults=compact)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.value))
        if self.kind == "grammar":
            return LLMatcher.grammar_from_lark(self.value)
        raise GenerationError(f"unknown constraint kind {self.kind!r}", hint=f"one of {', '.join(KINDS)}")


class Constraint:
    """One generation's grammar state: `pick` a token from a logits row, `cut` a proposal, `advance`."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def masked(self, row: np.ndarray) -> np.ndarray:
        """`row` with the tokens the grammar forbids next at -inf."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: row.shape[-1]].astype(bool)
        if not allowed.any():  # the grammar can go nowhere from here (llguidance says why)
            raise GenerationError(f"no token can continue the answer: {self._error()}", hint="check the grammar")
        return np.where(allowed, row.astype(np.float32), -np.inf)

    def pick(self, row: np.ndarray, sampler: Any) -> int:
        """The target's token under the grammar (greedy: the likeliest allowed one), consumed."""
        masked = self.masked(row)
        token = sampler.pick(masked, int(np.argmax(masked)))
        self.advance(token)
        return token

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GenerationError(f"the grammar refused token {token}: {self._error()}", hint="this is a dflash bug")

    def cut(self, proposal: list[int], limit: int) -> list[int]:
        """What to verify after the committed text: the tokens the grammar forces from here (a schema's keys and
        punctuation: the target can pick nothing else, whatever the draft guessed), then the proposal's tokens
        where it agrees with them, up to `limit` tokens and the first token the grammar forbids."""
        forced = self._matcher.compute_ff_tokens()
        if forced and proposal[: len(forced)] != forced:
            proposal = forced
        proposal = proposal[:limit]
        return proposal[: self._matcher.validate_tokens(proposal)]

    def _error(self) -> str:
        return self._matcher.get_error().splitlines()[0] if self._matcher.get_error() else "no error message"


def compile_constraint(spec: ConstraintSpec, lltokenizer: Any) -> Constraint:
    """A fresh Constraint for one generation; a spec the library cannot compile is a GenerationError naming why.
    `lltokenizer`: llguidance_tokenizer's, built once per engine."""
    import llguidance

    try:
        grammar = spec.grammar()
    except ValueError as exc:  # not a JSON object, say
        raise GenerationError(f"the {spec.kind} cannot be compiled: {exc}", hint="check its syntax") from None
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    if matcher.is_error():
        why = " ".join(line.strip() for line in matcher.get_error().splitlines() if line.strip())[:300]
        raise GenerationError(f"the {spec.kind} cannot be compiled: {why}", hint="check its syntax")
    return Constraint(matcher)


def llguidance_tokenizer(tokenizer: Any, vocab: int, eos_ids: list[int]) -> Any:
    """llguidance's view of the tokenizer (its tokens' bytes; 151k tokens take a moment: build it once)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=list(eos_ids) or tokenizer.eos_token_id)
