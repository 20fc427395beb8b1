"""The engine reads a prompt as Hugging Face's AutoTokenizer reads it from the user's target checkpoint, for
every family, with and without a chat template: a multimodal checkpoint's text path carries another model type,
from which Hugging Face would pick another tokenizer class (a Qwen3.5 one: 465 tokens against 416 here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_cli.cache.store import Cache
from dflash_cli.decoding.tokenizer import load_tokenizer
from dflash_cli.recipe.schema import load_recipe
from dflash_cli.stages.pipeline import artifact_path, build
from tests.fixtures.tiny_pairs import make_pair

CHATML = (  # for the checkpoints written without a template: each family is read templated too
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CODE = "".join(f"def f{i}(x):\n    return x + {i}  # comment {i}\n" for i in range(30))
FAMILIES = (
    *("qwen3", "llama", "qwen3_5", "qwen3_5_text", "qwen3_vl", "gemma4", "qwen3_moe", "qwen3_5_moe", "qwen3_next"),
    "gpt_oss",
)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_ids_equal_autotokenizer_on_the_users_checkpoint(tmp_path: Path, family: str) -> None:
    from transformers import AutoTokenizer

    pair = make_pair(tmp_path / "pair", family)
    if not (pair.target_dir / "chat_template.jinja").is_file():
        (pair.target_dir / "chat_template.jinja").write_text(CHATML)
    recipe = load_recipe(str(pair.write_recipe(tmp_path / "recipe.yaml")))
    cache = Cache(tmp_path / "cache")
    build(recipe, cache, upto="inject")
    ours = load_tokenizer(artifact_path(recipe, cache, "inject") / "target")
    theirs = AutoTokenizer.from_pretrained(str(pair.target_dir))
    assert type(ours) is type(theirs)
    assert ours(CODE)["input_ids"] == theirs(CODE)["input_ids"]
    assert theirs.chat_template
    # as the engine templates a prompt: text first, then its ids
    messages = [{"role": "user", "content": CODE}]
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert ours(text, add_special_tokens=False)["input_ids"] == list(expected)
