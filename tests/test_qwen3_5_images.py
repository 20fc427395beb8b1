"""Qwen3.5 (dense and MoE) with images: tiny random Qwen3_5(Moe)ForConditionalGeneration checkpoints (Gated
DeltaNet layers, M-RoPE over a rotated quarter of the head, Qwen3-VL's tower without deepstack) through the
real pipeline, against the multimodal model's own `generate` on prompts with one and with two images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.engines import prefix_and_static
from tests.fixtures.tiny_pairs import make_pair

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


def _image_prompts(hf, n: int, seed: int = 11):
    """(ids, pixel rows, grids): 1 or 2 images of random pixels and grids, text around them, each image's
    tokens expanded as the processor does (start, one token per merged 2x2 patch, end)."""
    c = hf.config
    rng = np.random.default_rng(seed)
    width = 3 * 2 * 8 * 8  # channels x temporal patch x 8 x 8 pixels
    text_top = min(c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id)
    out = []
    for i in range(n):
        grids = tuple((1, 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))) for _ in range(1 + i % 2))
        ids = list(map(int, rng.integers(2, text_top, int(rng.integers(1, 6)))))
        for g in grids:
            ids += [c.vision_start_token_id] + [c.image_token_id] * (int(np.prod(g)) // 4) + [c.vision_end_token_id]
            ids += list(map(int, rng.integers(2, text_top, int(rng.integers(0, 9)))))
        pixels = rng.standard_normal((sum(int(np.prod(g)) for g in grids), width)).astype(np.float32)
        out.append((ids, pixels, grids))
    return out


def _hf_generate(hf, ids, pixels, grids, new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            pixel_values=torch.from_numpy(pixels),
            image_grid_thw=torch.tensor(grids),
            mm_token_type_ids=(torch.tensor([ids]) == hf.config.image_token_id).int(),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_image_prompts_in_every_mode_equal_hf_generate(built) -> None:
    """20 prompts with one or two images: every mode, both graph forms == Hugging Face's generate."""
    engines, hf = built
    forms = dict(zip(("prefix", "static"), engines))
    for ids, pixels, grids in _image_prompts(hf, 20):
        want = _hf_generate(hf, ids, pixels, grids, NEW_TOKENS)
        for form, engine in forms.items():
            images = engine.images.prompt(ids, pixels, np.array(grids))
            for mode in MODES:
                got = engine.generate(ids, mode=mode, max_new_tokens=NEW_TOKENS, images=images).tokens
                stopped = len(got) == NEW_TOKENS or got[-1] in engine.eos_token_ids
                assert got == want[: len(got)] and stopped, f"{form} {mode}, grids {grids}"


@pytest.mark.slow
def test_image_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), hf = built
    for seed, (ids, pixels, grids) in enumerate(_image_prompts(hf, 4, seed=3)):
        images = engine.images.prompt(ids, pixels, np.array(grids))
        runs = {
            m: engine.generate(
                ids, mode=m, max_new_tokens=12, temperature=0.8, top_p=0.95, seed=seed, images=images
            ).tokens
            for m in MODES
        }
        assert all(r == runs["plain"] for r in runs.values()), f"seed {seed}"


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
