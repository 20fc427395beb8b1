"""Gemma 4 with images: a tiny random Gemma4ForConditionalGeneration (the 31B layout: sliding layers see all
of an image's tokens, ahead of them too) through the real pipeline, its images through the checkpoint's own
Pillow processor and our vision graph, against the multimodal model's own `generate` given the same
processed image."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.engines import prefix_and_static
from tests.fixtures.tiny_pairs import make_pair
from tests.vision_prompts import agrees, assert_image_sampling_same_seed

NEW_TOKENS = 12
MODES = ("plain", "dflash", "lookup", "hybrid")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from transformers import Gemma4ForConditionalGeneration

    root = tmp_path_factory.mktemp("gemma4_images")
    pair = make_pair(root / "pair", "gemma4")
    # room for two images of up to 70 tokens; the static form's prefill call takes a whole image
    prefix, static, hf = prefix_and_static(
        pair, root / "build", Gemma4ForConditionalGeneration, ctx_len=256, prefill_seq_len=72
    )
    yield (prefix, static), hf
    for engine in (prefix, static):
        engine.release_artifacts()


def _image_prompts(engine, hf, n: int, seed: int = 11):
    """(ids, processed batch): 1 or 2 random images of random sizes through the processor, text before,
    between and after, each image's tokens expanded as Gemma's processor does (boi, soft tokens, eoi)."""
    from PIL import Image

    c = hf.config
    rng = np.random.default_rng(seed)
    text_top = min(c.boi_token_id, c.eoi_token_id, c.image_token_id, c.video_token_id)
    out = []
    for i in range(n):
        sizes = [(int(rng.integers(16, 140)), int(rng.integers(16, 140))) for _ in range(1 + i % 2)]
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        batch = engine.images.image_processor(images=images, return_tensors="np")
        ids = list(map(int, rng.integers(2, text_top, int(rng.integers(1, 6)))))
        for tokens in batch["num_soft_tokens_per_image"]:
            ids += [c.boi_token_id] + [c.image_token_id] * int(tokens) + [c.eoi_token_id]
            ids += list(map(int, rng.integers(2, text_top, int(rng.integers(0, 9)))))
        out.append((ids, batch))
    return out


def _hf_generate(hf, ids, batch, new_tokens: int, bidirectional: bool = True) -> list[int]:
    kwargs = {"mm_token_type_ids": (torch.tensor([ids]) == hf.config.image_token_id).int()} if bidirectional else {}
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            pixel_values=torch.from_numpy(batch["pixel_values"]),
            image_position_ids=torch.from_numpy(batch["image_position_ids"]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_image_prompts_in_every_mode_equal_hf_generate(built) -> None:
    """20 prompts with one or two images: every mode, both graph forms == Hugging Face's generate. The images'
    bidirectional attention matters here: Hugging Face without it answers otherwise on some prompts."""
    engines, hf = built
    forms = dict(zip(("prefix", "static"), engines))
    causal_differs = 0
    for ids, batch in _image_prompts(engines[0], hf, 20):
        want = _hf_generate(hf, ids, batch, NEW_TOKENS)
        causal_differs += want != _hf_generate(hf, ids, batch, NEW_TOKENS, bidirectional=False)
        for form, engine in forms.items():
            images = engine.images.prompt(ids, batch["pixel_values"], batch["image_position_ids"])
            for mode in MODES:
                got = engine.generate(ids, mode=mode, max_new_tokens=NEW_TOKENS, images=images).tokens
                assert agrees(engine, got, want, NEW_TOKENS), f"{form} {mode}, {len(ids)} tokens"
    assert causal_differs > 0


@pytest.mark.slow
def test_image_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), hf = built
    prompts = _image_prompts(engine, hf, 4, seed=5)
    cases = [(i, engine.images.prompt(i, b["pixel_values"], b["image_position_ids"])) for i, b in prompts]
    assert_image_sampling_same_seed(engine, cases, MODES)


@pytest.mark.slow
def test_vision_graph_validated_against_hf_tower_and_embedder(built) -> None:
    (engine, _), _ = built
    report = json.loads((engine.export_dir / "validation.json").read_text())
    vision = [c for c in report["checks"] if c["graph"] == "vision"]
    assert [c["output"] for c in vision] == ["vision_embeds", "vision_embeds"]
    assert all(c["ok"] and c["max_diff"] < 1e-5 for c in vision)


@pytest.mark.slow
def test_readiness_covers_the_vision_graph(built) -> None:
    """`dflash check`'s static checks take the tower too: static at its image specialization (280 tokens,
    the processor's default cap), its ops listed against the allow-list, its fp16 hazards named."""
    from dflash_cli.readiness import readiness_report

    (engine, _), _ = built
    report = readiness_report(engine.export_dir)
    assert [g.graph for g in report.graphs] == ["target", "draft", "vision"]
    vision = report.graphs[-1]
    assert [(s.specialization, s.seq_len) for s in vision.shapes] == [("image", 280)]
    assert not vision.shapes[0].non_static and vision.shapes[0].error is None
    assert "MatMul" in vision.ops


def test_prefill_calls_never_split_an_image() -> None:
    """The static graphs (what an accelerator runs) take a fixed call length: an image's tokens, which
    attend to each other, must fit one call; the prefix-cache graphs give it a call of its own."""
    from dflash_cli.decoding.target_calls import chunk_bounds
    from dflash_cli.errors import GenerationError

    assert chunk_bounds(20, 8, [(3, 15)], variable=True) == [(0, 3), (3, 15), (15, 20)]
    assert chunk_bounds(20, 8, [(3, 9)], variable=False) == [(0, 3), (3, 11), (11, 19), (19, 20)]
    with pytest.raises(GenerationError, match="does not fit one prefill call of 8 tokens"):
        chunk_bounds(20, 8, [(3, 15)], variable=False)


@pytest.mark.slow
def test_run_with_images_on_the_command_line_equals_hf_generate(built, tmp_path) -> None:
    """`dflash run --image A --image B --prompt TEXT --json`: the checkpoint's processor and chat template,
    each image placeholder expanded to boi, its soft tokens and eoi, then every mode == HF generate."""
    from PIL import Image

    from tests.engines import dflash_ok

    (engine, _), hf = built
    rng = np.random.default_rng(3)
    paths = []
    for i, (h, w) in enumerate(((40, 56), (96, 32))):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    ids, _ = engine.encode_with_images("what is here?", paths)
    assert ids.count(hf.config.boi_token_id) == 2 == ids.count(hf.config.eoi_token_id)
    batch = engine.images.image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="np")
    want = _hf_generate(hf, ids, batch, NEW_TOKENS)
    cache = engine.compile_dir.parents[2]  # <build>/cache/artifacts/compile/<key>, beside <build>/recipe.yaml
    common = ["-r", str(cache.parent / "recipe.yaml"), "--cache-dir", str(cache)]
    images = [a for p in paths for a in ("--image", str(p))]
    for mode in MODES:
        out = dflash_ok(
            "run", *common, *images, "--prompt", "what is here?", "--json", "--mode", mode, "--max-new-tokens", "12"
        )
        doc = json.loads(out.stdout)
        assert doc["prompt_tokens"] == len(ids) and agrees(engine, doc["token_ids"], want, NEW_TOKENS), mode


@pytest.mark.slow
def test_int4_build_stores_no_float_tower_and_image_prompts_stay_lossless(tmp_path) -> None:
    """An int4 build: graphs only in the export (the tower validated on a deleted copy), the tower's and the
    language model's MatMuls quantised, and image prompts decode identically in every mode."""
    import onnx
    from transformers import AutoConfig

    from tests.engines import open_engine

    pair = make_pair(tmp_path / "pair", "gemma4")
    engine = open_engine(
        pair, tmp_path / "build", export={"ctx_len": 256}, compile={"ort": {"precision": "int4", "block_size": 16}}
    )
    assert (engine.export_dir / "vision.onnx.data").stat().st_size == 0
    assert not (engine.export_dir / "vision-check").exists()
    for graph in ("vision.onnx", "target_prefix.onnx"):
        ops = {n.op_type for n in onnx.load(str(engine.compile_dir / graph), load_external_data=False).graph.node}
        assert "MatMulNBits" in ops, graph
    hf = type("HF", (), {"config": AutoConfig.from_pretrained(str(pair.target_dir))})
    for ids, batch in _image_prompts(engine, hf, 6, seed=2):
        images = engine.images.prompt(ids, batch["pixel_values"], batch["image_position_ids"])
        runs = {m: engine.generate(ids, mode=m, max_new_tokens=12, images=images).tokens for m in MODES}
        assert all(r == runs["plain"] for r in runs.values()), len(ids)
