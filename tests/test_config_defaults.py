"""A target config field that Hugging Face defaults when it is absent gets the same default here: a Qwen3.5
checkpoint whose rope_parameters leave out mrope_section (the export died with a KeyError) builds and decodes
as Hugging Face's `generate` does, and the M-RoPE split is the model's own default."""

from __future__ import annotations

import json

from tests.engines import prefix_and_static
from tests.fixtures.tiny_pairs import make_pair
from tests.vision_prompts import assert_qwen_image_prompts_equal_hf


def test_mrope_section_defaults_as_each_models_rotary_embedding_does() -> None:
    from transformers import Qwen3_5TextConfig, Qwen3VLTextConfig

    from dflash_cli.modeling.vl_target import mrope_section_of

    assert mrope_section_of(Qwen3_5TextConfig()) == [11, 11, 10]
    assert mrope_section_of(Qwen3VLTextConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e6})) == [
        24,
        20,
        20,
    ]
    given = Qwen3_5TextConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 1, 1]})
    assert mrope_section_of(given) == [2, 1, 1]


def test_a_qwen3_5_config_without_mrope_section_builds_and_equals_hf_generate(tmp_path) -> None:
    """With images (the only path that reads the split): prompts with one and two images == Hugging Face."""
    from transformers import Qwen3_5ForConditionalGeneration

    pair = make_pair(tmp_path / "pair", "qwen3_5_images")
    config = pair.target_dir / "config.json"
    doc = json.loads(config.read_text())
    del doc["text_config"]["rope_parameters"]["mrope_section"]
    config.write_text(json.dumps(doc))
    prefix, static, hf = prefix_and_static(pair, tmp_path / "build", Qwen3_5ForConditionalGeneration, ctx_len=256)
    try:
        assert "mrope_section" not in hf.config.text_config.rope_parameters
        assert_qwen_image_prompts_equal_hf({"prefix": prefix}, hf, 4, 8, ("plain", "dflash"))
    finally:
        for engine in (prefix, static):
            engine.release_artifacts()
