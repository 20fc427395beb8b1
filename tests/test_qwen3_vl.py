"""Qwen3-VL targets, text-only prompts: a tiny random Qwen3VLForConditionalGeneration (its published layout:
text_config, model.language_model.*, a vision tower with deepstack mergers) through the real pipeline, against
the multimodal model's own `generate`. On text positions its M-RoPE equals RoPE, so the language model is the
Qwen3 target module; images are issue 34's next step."""

from __future__ import annotations

import json

import pytest

from tests.engines import assert_every_mode_equals_hf, assert_sampling_same_seed, mixed_prompts, prefix_and_static
from tests.fixtures.tiny_pairs import make_pair

NEW_TOKENS = 20
MODES = ("plain", "dflash", "lookup", "hybrid")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from transformers import Qwen3VLForConditionalGeneration

    root = tmp_path_factory.mktemp("qwen3_vl")
    pair = make_pair(root / "pair", "qwen3_vl")
    prefix, static, hf = prefix_and_static(pair, root / "build", Qwen3VLForConditionalGeneration)
    yield (prefix, static), hf
    for engine in (prefix, static):
        engine.release_artifacts()


def _text_prompts(hf, n: int = 32) -> list[list[int]]:
    """Mixed prompts below the vision token ids (the tiny vocabulary's last entries): text only."""
    lowest = min(hf.config.image_token_id, hf.config.video_token_id, hf.config.vision_start_token_id)
    lowest = min(lowest, hf.config.vision_end_token_id)
    return mixed_prompts(lowest, n)


@pytest.mark.slow
def test_text_prompts_in_every_mode_equal_hf_generate(built) -> None:
    engines, hf = built
    assert type(hf).__name__ == "Qwen3VLForConditionalGeneration"
    assert hf.config.text_config.rope_parameters["mrope_interleaved"]
    forms = dict(zip(("prefix", "static"), engines))
    assert_every_mode_equals_hf(forms, hf, _text_prompts(hf), NEW_TOKENS, MODES)


@pytest.mark.slow
def test_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), hf = built
    assert_sampling_same_seed(engine, min(hf.config.image_token_id, hf.config.vision_end_token_id), MODES)


@pytest.mark.slow
def test_export_validated_against_the_text_model(built) -> None:
    """The export compared its graphs with Hugging Face's Qwen3-VL text model (it has no causal-LM class)."""
    (engine, _), _ = built
    report = json.loads((engine.export_dir / "validation.json").read_text())
    hf_checks = [c for c in report["checks"] if c["call"] == "vs-huggingface"]
    assert {c["output"] for c in hf_checks} >= {"tokens", "context_features"} and all(c["ok"] for c in hf_checks)
    facts = json.loads((engine.export_dir / "export.json").read_text())
    assert facts["graphs"]["target"]["num_layers"] == 4
