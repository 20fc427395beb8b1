"""`run.chat_template` applies the tokenizer's template (with `enable_thinking` for Qwen3)."""

from __future__ import annotations

from dflash_cli.cache.store import Cache
from dflash_cli.decoding.engine import Engine
from dflash_cli.recipe.schema import load_recipe

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}<assistant>"
)


def _engine(qwen3_engine, *overrides):
    recipe = load_recipe(str(qwen3_engine.recipe.source), list(overrides))
    engine = Engine.load(recipe, Cache(qwen3_engine.compile_dir.parents[2]))  # run.* is in no cache key
    engine.tokenizer.chat_template = TEMPLATE
    return engine


def test_template_applied_with_thinking_switch(qwen3_engine):
    engine = _engine(qwen3_engine, "run.chat_template=true", "run.enable_thinking=false")
    ids = engine.encode_prompt("hi")
    assert engine.tokenizer.decode(ids) == "<user>hi\n[no-think]<assistant>"
    multi = engine.encode_prompt([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert engine.tokenizer.decode(multi).startswith("<user>a\n<assistant>b\n")


def test_template_off_by_default(qwen3_engine):
    engine = _engine(qwen3_engine)
    assert engine.tokenizer.decode(engine.encode_prompt("hi")) == "hi"
