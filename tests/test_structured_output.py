"""Structured output: every mode's constrained answer equals constrained plain decoding's, token for token
(greedy, and sampled with a seed), and follows its grammar; what cannot be constrained is refused by name."""

from __future__ import annotations

import json
import re

import pytest

from dflash_cli.decoding.constraint import ConstraintSpec
from tests.engines import mixed_prompts

MODES = ("plain", "dflash", "lookup", "hybrid")
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["n", "ok", "tag"],
    "additionalProperties": False,
}


def follows(spec: ConstraintSpec, text: str) -> bool:
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "choice":
        return text in spec.value
    if spec.kind == "grammar":  # start: "(" ("x" | "y")+ ")"
        return re.fullmatch(r"\([xy]+\)", text) is not None
    import jsonschema

    jsonschema.validate(json.loads(text), spec.value if spec.kind == "json_schema" else {"type": "object"})
    return True


SPECS = [
    ConstraintSpec("regex", r"[0-9]{3}-[a-z]{2}\."),
    ConstraintSpec("choice", ["yes", "no", "maybe so"]),
    ConstraintSpec("json_schema", SCHEMA),
    ConstraintSpec("json_object"),
    ConstraintSpec("grammar", 'start: "(" ("x" | "y")+ ")"'),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.kind for s in SPECS])
def test_every_mode_equals_constrained_plain_and_follows_the_grammar(qwen3_logits_engine, spec):
    engine = qwen3_logits_engine
    for prompt in mixed_prompts(engine.vocab_size, n=4, seed=9):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=48, constraint=spec)
        for mode in MODES[1:]:
            assert engine.generate(prompt, mode=mode, max_new_tokens=48, constraint=spec).tokens == plain.tokens, mode
        text = engine.decode([t for t in plain.tokens if t not in engine.eos_token_ids])
        # The bounded grammars end within the budget; a JSON object or (x|y)+ may go on as long as the model likes.
        assert plain.stopped == "stop_token" or spec.kind in ("json_object", "grammar"), (spec.kind, text)
        if plain.stopped == "stop_token":
            assert follows(spec, text), (spec.kind, text)


def test_sampled_constrained_output_is_the_same_in_every_mode(qwen3_logits_engine):
    engine = qwen3_logits_engine
    spec = SPECS[2]
    for seed in range(3):
        kw = dict(max_new_tokens=48, temperature=1.0, seed=seed, constraint=spec)
        runs = {m: engine.generate([5, 6, 7, 8], mode=m, **kw).tokens for m in MODES}
        assert all(r == runs["plain"] for r in runs.values()), seed
        assert follows(spec, engine.decode([t for t in runs["plain"] if t not in engine.eos_token_ids]))


def test_a_proposal_is_cut_at_its_first_forbidden_token(qwen3_logits_engine):
    engine = qwen3_logits_engine
    grammar = engine.compile_constraint(ConstraintSpec("choice", ["yes", "no"]))
    yes = engine.encode_prompt("yes")
    assert grammar.cut(yes + engine.encode_prompt("xyz"), 16) == yes
    assert grammar.cut(engine.encode_prompt("xyz"), 16) == []


def test_tokens_the_grammar_forces_are_proposed_whatever_the_draft_guessed(qwen3_logits_engine):
    engine = qwen3_logits_engine
    grammar = engine.compile_constraint(ConstraintSpec("regex", "abcdefgh[0-9]"))
    forced = grammar.cut([], 16)
    assert forced and engine.decode(forced) == "abcdefgh"[: len(engine.decode(forced))]
    assert grammar.cut(engine.encode_prompt("zz"), 16) == forced and grammar.cut([], 2) == forced[:2]


def test_what_cannot_be_constrained_is_refused_by_name(qwen3_engine, qwen3_logits_engine):
    from dflash_cli.errors import GenerationError

    with pytest.raises(GenerationError, match="emits token ids only") as caught:
        qwen3_engine.generate([5, 6], max_new_tokens=2, constraint=SPECS[0])
    assert "export.logits=true" in caught.value.hint
    with pytest.raises(GenerationError, match="regex cannot be compiled: .*unclosed character class"):
        qwen3_logits_engine.generate([5, 6], max_new_tokens=2, constraint=ConstraintSpec("regex", "([a-z"))
    with pytest.raises(GenerationError, match="grammar cannot be compiled"):
        qwen3_logits_engine.compile_constraint(ConstraintSpec("grammar", "start: ("))
