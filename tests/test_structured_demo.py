"""Structured output on the shipped demo pair (a trained draft, so real acceptance): 40 prompts under JSON schemas,
a regex and a required tool call, in every mode equal to constrained plain decoding and valid (jsonschema);
same-seed sampling; tool calls through the demo's own chat template."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from dflash_cli.decoding.constraint import ConstraintSpec
from dflash_cli.serve.tools import ToolRequest, parse_calls

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "dflash", "lookup", "hybrid")
SUMMARY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
        "args": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_]{1,8}$"}, "maxItems": 3},
        "returns": {"enum": ["int", "str", "list", "bool", "None"]},
    },
    "required": ["name", "args", "returns"],
    "additionalProperties": False,
}
SCORE = {
    "type": "object",
    "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 10}, "pure": {"type": "boolean"}},
    "required": ["score", "pure"],
    "additionalProperties": False,
}
SIGNATURE = r"def [a-z_]{1,12}\([a-z_, ]{0,24}\):"
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOL_CALL = ToolRequest([ADD], "add", parallel=False).constraint()
SPECS = {
    "summary": ConstraintSpec("json_schema", SUMMARY),
    "score": ConstraintSpec("json_schema", SCORE),
    "signature": ConstraintSpec("regex", SIGNATURE),
    "tool_call": TOOL_CALL,
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    return build_engine(load_recipe("demo", ["export.logits=true"]), Cache(tmp_path_factory.mktemp("demo-logits")))


def prompts(engine, n):
    from dflash_cli.bench.datasets import load_dataset

    return [engine.encode_prompt(s.turns[0]) for s in load_dataset("humaneval", max_samples=n, seed=3)]


def valid(kind: str, text: str) -> bool:
    if kind == "signature":
        return re.fullmatch(SIGNATURE, text) is not None
    if kind == "tool_call":
        calls = parse_calls(text).calls
        if len(calls) != 1:
            return False
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), ADD["function"]["parameters"])
        return True
    jsonschema.validate(json.loads(text), SUMMARY if kind == "summary" else SCORE)
    return True


def test_forty_constrained_prompts_equal_plain_in_every_mode_and_validate(demo):
    eos, checked, taus = set(demo.eos_token_ids), 0, []
    for ids in prompts(demo, 10):
        for kind, spec in SPECS.items():
            runs = {m: demo.generate(ids, mode=m, max_new_tokens=96, constraint=spec) for m in MODES}
            plain = runs["plain"]
            for mode, res in runs.items():
                assert res.tokens == plain.tokens, (kind, mode)
            assert plain.stopped == "stop_token", (kind, demo.decode(plain.tokens))
            assert valid(kind, demo.decode([t for t in plain.tokens if t not in eos])), kind
            taus.append(runs["dflash"].tau)
            checked += 1
    assert checked == 40 and sum(taus) / len(taus) > 1.0


def test_same_seed_sampling_under_a_schema_equals_plain(demo):
    for seed, ids in enumerate(prompts(demo, 4)):
        kw = dict(max_new_tokens=96, temperature=0.8, top_p=0.95, seed=seed, constraint=SPECS["summary"])
        runs = {m: demo.generate(ids, mode=m, **kw).tokens for m in MODES}
        assert all(r == runs["plain"] for r in runs.values()), seed
        assert valid("summary", demo.decode([t for t in runs["plain"] if t not in demo.eos_token_ids]))


def test_the_demo_template_renders_tools_and_a_required_call_comes_back(demo):
    messages = [{"role": "user", "content": "what is 2 + 1?"}]
    ids = demo.encode_chat(messages, None, [ADD])
    assert "<tool_call>" in demo.decode(ids) and '"add"' in demo.decode(ids)
    res = demo.generate(ids, mode="dflash", max_new_tokens=96, constraint=TOOL_CALL)
    assert valid("tool_call", demo.decode([t for t in res.tokens if t not in demo.eos_token_ids]))
