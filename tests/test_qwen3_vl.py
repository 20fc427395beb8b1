"""Qwen3-VL targets: a tiny random Qwen3VLForConditionalGeneration (its published layout: text_config,
model.language_model.*, a vision tower with deepstack mergers) through the real pipeline, against the
multimodal model's own `generate`, on text-only prompts and on prompts with one and with two images (the
images through our vision graph, their features into the language graph with M-RoPE positions)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.engines import assert_every_mode_equals_hf, assert_sampling_same_seed, mixed_prompts, prefix_and_static
from tests.fixtures.tiny_pairs import make_pair
from tests.vision_prompts import (
    agrees,
    assert_image_sampling_same_seed,
    assert_qwen_image_prompts_equal_hf,
    qwen_hf_generate,
    qwen_image_prompts,
)

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


def _image_prompts(hf, n: int):
    return qwen_image_prompts(hf, n)


@pytest.mark.slow
def test_image_prompts_in_every_mode_equal_hf_generate(built) -> None:
    """24 prompts with one or two images: every mode, both graph forms == Hugging Face's generate."""
    engines, hf = built
    assert_qwen_image_prompts_equal_hf(dict(zip(("prefix", "static"), engines)), hf, 24, NEW_TOKENS, MODES)


@pytest.mark.slow
def test_image_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), hf = built
    cases = [(ids, engine.images.prompt(ids, pixels, np.array(g))) for ids, pixels, g in _image_prompts(hf, 6)]
    assert_image_sampling_same_seed(engine, cases, MODES)


@pytest.mark.slow
def test_vision_graph_validated_against_hf_tower(built) -> None:
    (engine, _), _ = built
    report = json.loads((engine.export_dir / "validation.json").read_text())
    vision = [c for c in report["checks"] if c["graph"] == "vision"]
    assert {c["output"] for c in vision} == {"vision_embeds", "deepstack_embeds"} and len(vision) == 4
    assert all(c["ok"] and c["max_diff"] < 1e-5 for c in vision)


def test_images_that_do_not_match_the_prompt_are_a_clear_error(built) -> None:
    from dflash_cli.errors import GenerationError

    (engine, _), hf = built
    ids, pixels, grids = _image_prompts(hf, 1)[0]
    fewer = [t for t in ids if t != hf.config.image_token_id]  # the images' tokens left out
    with pytest.raises(GenerationError, match="images do not match the prompt"):
        engine.images.prompt(fewer, pixels, np.array(grids))
    images = engine.images.prompt(ids, pixels, np.array(grids))
    with pytest.raises(GenerationError, match="made for another prompt"):
        engine.generate(ids + [5], mode="plain", max_new_tokens=2, images=images)


def test_an_image_too_long_for_the_processor_is_one_error_in_run_and_a_400_in_serve(built, tmp_path) -> None:
    """A 4000x16 image (aspect ratio 250, over the 200 of Qwen-VL's processor) was a ValueError traceback in
    `dflash run --image` and a 500 in serve: now `error:` + `hint:` (exit 1) and a 400 naming the part."""
    import base64

    from PIL import Image
    from typer.testing import CliRunner

    from dflash_cli.cli.app import create_app
    from tests.serving import http, running_server

    (engine, _), _ = built
    wide = tmp_path / "wide.png"
    Image.new("RGB", (4000, 16)).save(wide)
    cache = engine.compile_dir.parents[2]
    args = ["run", "-r", str(cache.parent / "recipe.yaml"), "--cache-dir", str(cache), "--image", str(wide)]
    result = CliRunner().invoke(create_app(), [*args, "--prompt", "x"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), repr(result.exception)  # no traceback
    lines = result.output.strip().splitlines()
    assert lines[-2] == (
        f"error: image {wide} is 4000x16 pixels: its aspect ratio 250 is over 200, "
        "the most this model's image processor takes"
    )
    assert lines[-1].startswith("hint: crop the image")
    url = "data:image/png;base64," + base64.b64encode(wide.read_bytes()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    with running_server(engine, queue_size=2) as (base, _):
        reply = http("POST", base + "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.json()
    assert reply.json()["error"]["message"].startswith("messages[0].content[0] is 4000x16 pixels: its aspect ratio")


@pytest.mark.slow
def test_run_with_images_on_the_command_line_equals_hf_generate(built, tmp_path) -> None:
    """`dflash run --image A --image B --prompt TEXT --json`: the checkpoint's image processor and chat template
    (each image placeholder expanded to its tokens), then every mode == HF generate on the same processed inputs;
    a missing or broken image file is a one-line error."""
    from PIL import Image
    from typer.testing import CliRunner

    from dflash_cli.cli.app import create_app
    from tests.engines import dflash_ok

    (engine, _), hf = built
    rng = np.random.default_rng(3)
    paths = []
    for i, (h, w) in enumerate(((40, 56), (64, 32))):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    ids, _ = engine.encode_with_images("what is here?", paths)
    batch = engine.images.image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="np")
    grids = tuple(map(tuple, batch["image_grid_thw"].tolist()))
    want = qwen_hf_generate(hf, ids, batch["pixel_values"].astype(np.float32), grids, 12)
    cache = engine.compile_dir.parents[2]  # <build>/cache/artifacts/compile/<key>, beside <build>/recipe.yaml
    common = ["-r", str(cache.parent / "recipe.yaml"), "--cache-dir", str(cache)]
    images = [a for p in paths for a in ("--image", str(p))]
    for mode in MODES:
        out = dflash_ok(
            "run", *common, *images, "--prompt", "what is here?", "--json", "--mode", mode, "--max-new-tokens", "12"
        )
        doc = json.loads(out.stdout)
        assert doc["prompt_tokens"] == len(ids) and agrees(engine, doc["token_ids"], want, 12), mode
    (tmp_path / "bad.png").write_bytes(b"not an image")
    for bad, words in ((tmp_path / "missing.png", "image not found"), (tmp_path / "bad.png", "cannot read image")):
        result = CliRunner().invoke(create_app(), ["run", *common, "--image", str(bad), "--prompt", "x"])
        assert result.exit_code != 0 and words in result.output


@pytest.mark.slow
def test_serve_takes_image_parts_streamed_or_not_and_refuses_bad_ones(built, tmp_path) -> None:
    """OpenAI chat content parts with an inline image through the official client: the same text as the
    engine on the same image and prompt, streamed or not; each bad image part is a 400 and the server
    goes on serving."""
    import base64
    import io

    import openai
    from PIL import Image

    from tests.serving import http, running_server

    (engine, _), _ = built
    path = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(path)
    ids, images = engine.encode_with_images("what is here?", [path])
    want = engine.decode(engine.generate(ids, mode="dflash", max_new_tokens=12, images=images).tokens)
    data = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()

    def message(url: str) -> list[dict]:
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is here?"}]
        return [{"role": "user", "content": parts}]

    with running_server(engine, queue_size=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.chat.completions.create(model="tiny", messages=message(data), max_tokens=12, temperature=0)
        assert got.choices[0].message.content == want and got.usage.prompt_tokens == len(ids)
        stream = client.chat.completions.create(
            model="tiny", messages=message(data), max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
        huge = io.BytesIO()
        Image.new("L", (9000, 8000)).save(huge, format="PNG")  # 72 megapixels, a small file
        bad = {
            "data:image/png;base64," + base64.b64encode(huge.getvalue()).decode(): "too large",
            "https://example.com/cat.png": "remote image URLs are not fetched",
            "data:image/png;base64,@@@": "does not decode",
            "data:image/png;base64," + base64.b64encode(b"not an image").decode(): "not an image PIL can read",
            "data:text/plain;base64,aGk=": "data:image/<type>;base64",
            str(path): "local image files are not served",
            "file://" + str(path): "local image files are not served",
        }
        for image_url, words in bad.items():
            body = {"model": "tiny", "messages": message(image_url), "max_tokens": 4}
            reply = http("POST", url + "/v1/chat/completions", body)
            assert reply.status_code == 400 and words in reply.json()["error"]["message"], image_url
        many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}}] * 9}]
        reply = http("POST", url + "/v1/chat/completions", {"model": "tiny", "messages": many, "max_tokens": 4})
        assert reply.status_code == 400 and "at most 8" in reply.json()["error"]["message"]
        again = client.chat.completions.create(model="tiny", messages=message(data), max_tokens=12, temperature=0)
        assert again.choices[0].message.content == want  # still serving
    # files under the directory the operator allowed (serve.allowed_local_media_path), and only there
    import copy

    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "p.png").write_bytes(path.read_bytes())
    allowing = copy.copy(engine)
    allowing.settings = dataclasses.replace(engine.settings, allowed_local_media_path=str(tmp_path / "media"))
    with running_server(allowing, queue_size=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        local = client.chat.completions.create(
            model="tiny", messages=message(f"file://{tmp_path}/media/p.png"), max_tokens=12, temperature=0
        )
        assert local.choices[0].message.content == want
        for outside in (str(path), f"{tmp_path}/media/../photo.png"):
            reply = http("POST", url + "/v1/chat/completions", {"model": "tiny", "messages": message(outside)})
            assert (
                reply.status_code == 400 and "outside the allowed media directory" in reply.json()["error"]["message"]
            )


@pytest.mark.slow
def test_bench_rows_with_images(built, tmp_path) -> None:
    """`dflash bench --dataset FILE.jsonl` rows may carry `images` (paths beside the file): every mode runs
    them and the lossless check passes; a row naming a missing image is refused before anything runs."""
    from PIL import Image
    from typer.testing import CliRunner

    from dflash_cli.cli.app import create_app
    from tests.engines import dflash_ok

    (engine, _), _ = built
    rng = np.random.default_rng(8)
    for name, (h, w) in (("a.png", (32, 48)), ("b.png", (56, 24))):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(tmp_path / name)
    rows = [
        {"prompt": "what is here?", "images": ["a.png"]},
        {"prompt": "and these?", "images": ["a.png", "b.png"]},
        {"prompt": "no picture"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = engine.compile_dir.parents[2]
    common = ["-r", str(cache.parent / "recipe.yaml"), "--cache-dir", str(cache)]
    out = dflash_ok("bench", *common, "--dataset", str(data), "--max-new-tokens", "8", "--json")
    doc = json.loads(out.stdout)
    assert doc["lossless"] == {"checked": True, "mismatches": []}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "images": ["missing.png"]}) + "\n")
    result = CliRunner().invoke(create_app(), ["bench", *common, "--dataset", str(bad), "--max-new-tokens", "4"])
    assert result.exit_code != 0 and "missing.png is not found" in result.output


@pytest.mark.slow
def test_int4_build_stores_no_float_tower_and_image_prompts_stay_lossless(tmp_path) -> None:
    """An int4 build: the export writes graphs only (the tower validated on a copy that is then deleted), the
    compile quantises the tower's MatMuls too, and image prompts decode identically in every mode."""
    import onnx

    from tests.engines import open_engine

    pair = make_pair(tmp_path / "pair", "qwen3_vl")
    engine = open_engine(pair, tmp_path / "build", compile={"ort": {"precision": "int4", "block_size": 16}})
    assert (engine.export_dir / "vision.onnx.data").stat().st_size == 0
    assert not (engine.export_dir / "vision-check").exists()
    report = json.loads((engine.export_dir / "validation.json").read_text())
    assert [c["ok"] for c in report["checks"] if c["graph"] == "vision"] == [True] * 4
    ops = {n.op_type for n in onnx.load(str(engine.compile_dir / "vision.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(pair.target_dir))
    for ids, pixels, grids in _image_prompts(SimpleNamespace(config=hf_config), 8):
        images = engine.images.prompt(ids, pixels, np.array(grids))
        runs = {m: engine.generate(ids, mode=m, max_new_tokens=12, images=images).tokens for m in MODES}
        assert all(r == runs["plain"] for r in runs.values()), grids


def test_hf_text_lm_of_the_artifact_is_the_multimodal_models_text_path(built) -> None:
    """`dflash check`'s fp32 reference (readiness/logit_gap.py): Qwen3-VL's text model has no causal-LM class,
    so ours wraps it, loaded from the inject artifact: the multimodal model's logits on a text prompt."""
    from dflash_cli.exporting.hf_reference import hf_text_lm

    (engine, _), hf = built
    inject = engine.compile_dir.parents[1] / "inject" / engine.artifact_keys["inject"] / "target"
    ours = hf_text_lm(inject)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, hf(input_ids=ids).logits)


@pytest.mark.slow
def test_qaic_bundle_has_three_programs_that_fit_one_card(tmp_path) -> None:
    """`dflash compile --backend qaic --emit-script`: the target, the draft and the vision tower, each with
    its specializations (the tower at its image tokens), a compile script for all three, and a placement
    (target 8, draft 4, vision 4 cores) that fits one 16-core card; the script runs against the fake compiler."""
    import os
    import subprocess
    from pathlib import Path

    from tests.engines import dflash_ok

    pair = make_pair(tmp_path / "pair", "qwen3_vl")
    recipe = str(pair.write_recipe(tmp_path / "recipe.yaml", export={"dtype": "fp16"}, compile={"backend": "qaic"}))
    bundle = tmp_path / "bundle"
    dflash_ok("compile", "-r", recipe, "--cache-dir", str(tmp_path / "cache"), "--emit-script", str(bundle))
    for graph in ("target", "draft", "vision"):
        assert (bundle / f"{graph}.onnx").is_file() and (bundle / graph / "specializations.json").is_file(), graph
    specs = json.loads((bundle / "vision" / "specializations.json").read_text())["specializations"]
    assert specs == [{"name": "Image", "symbols": {"seq_len": "256"}}]
    assert not (bundle / "vision" / "custom_io.yaml").exists()  # no retained state
    script = (bundle / "compile.sh").read_text()
    assert script.count("-aic-num-cores=8") == 1 and script.count("-aic-num-cores=4") == 2
    assert "done: target/qpc and draft/qpc and vision/qpc" in script
    fake = Path(__file__).parent / "bin" / "fake-qaic-compile"
    env = {**os.environ, "QAIC_COMPILE": str(fake), "FAKE_QAIC_RECORD": str(tmp_path / "record")}
    env.pop("FAKE_QAIC_FAIL", None)
    run = subprocess.run(["bash", str(bundle / "compile.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert all((bundle / g / "qpc" / "programqpc.bin").is_file() for g in ("target", "draft", "vision"))
