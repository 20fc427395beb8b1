"""Qwen3.5 (dense and MoE) with images: tiny random Qwen3_5(Moe)ForConditionalGeneration checkpoints (Gated
DeltaNet layers, M-RoPE over a rotated quarter of the head, Qwen3-VL's tower without deepstack) through the
real pipeline, against the multimodal model's own `generate` on prompts with one and with two images."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.engines import prefix_and_static
from tests.fixtures.tiny_pairs import make_pair
from tests.vision_prompts import (
    assert_image_sampling_same_seed,
    assert_qwen_image_prompts_equal_hf,
    qwen_image_prompts,
)

NEW_TOKENS = 12
MODES = ("plain", "dflash", "lookup", "hybrid")


@pytest.fixture(scope="module", params=["qwen3_5_images", "qwen3_5_moe_images"])
def built(request, tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp(request.param)
    pair = make_pair(root / "pair", request.param)
    kind = "Qwen3_5Moe" if "moe" in request.param else "Qwen3_5"
    hf_class = getattr(transformers, f"{kind}ForConditionalGeneration")
    prefix, static, hf = prefix_and_static(pair, root / "build", hf_class, ctx_len=256)
    yield (prefix, static), hf
    for engine in (prefix, static):
        engine.release_artifacts()


@pytest.mark.slow
def test_image_prompts_in_every_mode_equal_hf_generate(built) -> None:
    """20 prompts with one or two images: every mode, both graph forms == Hugging Face's generate."""
    engines, hf = built
    assert_qwen_image_prompts_equal_hf(dict(zip(("prefix", "static"), engines)), hf, 20, NEW_TOKENS, MODES)


@pytest.mark.slow
def test_image_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), hf = built
    prompts = qwen_image_prompts(hf, 4, seed=3)
    assert_image_sampling_same_seed(
        engine, [(i, engine.images.prompt(i, p, np.array(g))) for i, p, g in prompts], MODES
    )


@pytest.mark.slow
def test_vision_graph_validated_against_hf_tower(built) -> None:
    """Qwen3.5's tower: Qwen3-VL's without deepstack, so the graph has one output."""
    (engine, _), _ = built
    report = json.loads((engine.export_dir / "validation.json").read_text())
    vision = [c for c in report["checks"] if c["graph"] == "vision"]
    assert [c["output"] for c in vision] == ["vision_embeds"] * 2
    assert all(c["ok"] and c["max_diff"] < 1e-5 for c in vision)


def test_a_qaic_build_keeps_the_text_path_only(tmp_path) -> None:
    """QAIC's bundle has no vision program yet: convert keeps no tower for a QAIC build of a Qwen3.5 checkpoint."""
    from types import SimpleNamespace

    from dflash_cli.stages.convert import describe

    pair = make_pair(tmp_path / "pair", "qwen3_5_images")
    recipe = pair.recipe()
    assert describe(recipe).vision_cfg is not None
    recipe.compile = SimpleNamespace(backend="qaic")
    assert describe(recipe).vision_cfg is None
