"""inject: cross-checkpoint weights land where export expects them, and fc scaling is harmless."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_cli.checkpoints import locate as ckpt
from dflash_cli.checkpoints.weights import WeightStore
from dflash_cli.errors import CheckpointError
from dflash_cli.pairing.pair import PairInfo
from dflash_cli.stages import convert, inject
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.inject import fc_scale, fused_context
from tests.fixtures.tiny_pairs import TinyPair

FP16_MAX = torch.finfo(torch.float16).max


def build(pair: TinyPair, root: Path) -> Path:
    recipe = pair.recipe()
    for stage, inputs in ((convert.STAGE, {}), (inject.STAGE, {"convert": root / "convert"})):
        (root / stage.name).mkdir(parents=True)
        stage.run(StageContext(recipe=recipe, out_dir=root / stage.name, inputs=inputs, progress=lambda _m: None))
    return root / "inject"


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyPair, Path]:
    pair = request.getfixturevalue(f"tiny_{request.param}_pair")
    return pair, build(pair, tmp_path_factory.mktemp(f"inject_{request.param}"))


def test_stage_contract() -> None:
    assert (inject.STAGE.name, inject.STAGE.version, inject.STAGE.upstream) == ("inject", 3, ("convert",))
    assert inject.STAGE.key_fields(object()) == {}


def test_layout_links_convert_and_adds_only_the_fused_context(built: tuple[TinyPair, Path]) -> None:
    _, out = built
    converted = out.parent / "convert"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    before = sorted(str(p.relative_to(converted)) for p in converted.rglob("*") if p.is_file())
    assert files == sorted([*before, "target/dflash.safetensors", "draft/target.model.safetensors"])
    # No weight is copied: every weight file but the new fused-context file is convert's own inode.
    for rel in before:
        if rel.endswith(".safetensors"):
            assert os.path.samefile(out / rel, converted / rel)
    assert os.path.samefile(out / "draft" / "target.model.safetensors", converted / "target" / "model.safetensors")
    new_bytes = (out / "target" / "dflash.safetensors").stat().st_size
    assert new_bytes < 0.1 * (converted / "target" / "model.safetensors").stat().st_size


def test_draft_gets_target_embeddings_and_head(built: tuple[TinyPair, Path]) -> None:
    pair, out = built
    source = load_file(pair.target_dir / "model.safetensors")
    draft = WeightStore.open(out / "draft")
    original_draft = load_file(pair.draft_dir / "model.safetensors")
    assert set(draft.names()) == set(original_draft) | {"embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(draft.get("embed_tokens.weight"), source["model.embed_tokens.weight"])
    # tied (qwen3 fixture): no lm_head on disk, the embedding doubles as the head
    head = source.get("lm_head.weight", source["model.embed_tokens.weight"])
    assert ("lm_head.weight" in source) is (pair.family == "llama")
    assert torch.equal(draft.get("lm_head.weight"), head)
    assert all(torch.equal(draft.get(k), original_draft[k]) for k in original_draft)


def test_target_gets_scaled_fc_and_hidden_norm(built: tuple[TinyPair, Path]) -> None:
    pair, out = built
    info = PairInfo.from_json((out / "pair.json").read_text())
    draft = load_file(pair.draft_dir / "model.safetensors")
    target = WeightStore.open(out / "target")
    assert info.fc_scale == fc_scale(draft["fc.weight"]) == 1.0  # std 0.02 weights need no scaling
    assert torch.equal(target.get("dflash.fc.weight"), draft["fc.weight"] / info.fc_scale)
    assert torch.equal(target.get("dflash.hidden_norm.weight"), draft["hidden_norm.weight"])
    assert target.shape("dflash.fc.weight") == (64, 2 * 64)
    converted = WeightStore.open(out.parent / "convert" / "target")
    assert set(target.names()) == set(converted.names()) | {"dflash.fc.weight", "dflash.hidden_norm.weight"}


def test_fc_scale_is_recorded(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    pair = tiny_qwen3_pair.copy_to(tmp_path / "pair")
    path = pair.draft_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["fc.weight"] = tensors["fc.weight"] * 1000
    ckpt.save_state_dict(tensors, path)
    out = build(pair, tmp_path / "build")
    info = PairInfo.from_json((out / "pair.json").read_text())
    bound = 128**0.5 * float(tensors["fc.weight"].norm(dim=1).max()) / 128
    assert bound <= info.fc_scale < 2 * bound and math.log2(info.fc_scale).is_integer()
    target = WeightStore.open(out / "target")
    scaled = target.get("dflash.fc.weight")
    assert scaled.dtype == tensors["fc.weight"].dtype  # a power of two: exact in the draft's own dtype
    assert torch.equal(scaled * info.fc_scale, tensors["fc.weight"])


def test_missing_injected_tensor_is_an_error(tiny_llama_pair: TinyPair, tmp_path: Path, monkeypatch) -> None:
    real_write = inject.write_index

    def lossy_write(root: Path, entries: dict, stacks=None) -> None:
        real_write(root, {k: v for k, v in entries.items() if k != "lm_head.weight" or root.name != "draft"}, stacks)

    monkeypatch.setattr(inject, "write_index", lossy_write)
    with pytest.raises(CheckpointError) as exc:
        build(tiny_llama_pair, tmp_path)
    assert "injected draft tensor lm_head.weight is missing" in exc.value.message
    assert "1.00" in exc.value.hint


def test_scaled_fc_is_equivalent_and_fits_fp16() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden, n_layers = 64, 3
    fc = 20.0 * torch.randn(hidden, n_layers * hidden, generator=gen)
    norm = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    # large features (|x| <= 400, inside fp16) with one row aligned to fc's largest row: the worst case
    features = [400.0 * (2 * torch.rand(2, 5, hidden, generator=gen) - 1) for _ in range(n_layers)]
    worst_row = fc[fc.norm(dim=1).argmax()]
    aligned = (400.0 * torch.sign(worst_row)).split(hidden)
    for f, a in zip(features, aligned):
        f[0, 0] = a

    scale = fc_scale(fc)
    assert scale > 1
    unscaled_out = torch.cat(features, -1) @ fc.T
    scaled_out = torch.cat(features, -1) @ (fc / scale).T
    assert unscaled_out.abs().max() > FP16_MAX and not torch.isfinite(unscaled_out.half()).all()
    assert scaled_out.abs().max() < FP16_MAX and torch.isfinite(scaled_out.half()).all()

    reference = fused_context(features, fc, norm, eps=1e-6)
    scaled = fused_context(features, fc / scale, norm, eps=1e-6)
    assert torch.allclose(scaled, reference, rtol=1e-4, atol=1e-5)


def test_fused_context_matches_definition() -> None:
    gen = torch.Generator().manual_seed(1)
    features = [torch.randn(1, 3, 8, generator=gen) for _ in range(2)]
    fc, norm = torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    y = torch.nn.functional.linear(torch.cat(features, -1), fc)
    expected = torch.nn.functional.rms_norm(y, (8,), weight=norm, eps=1e-6)
    assert torch.allclose(fused_context(features, fc, norm, 1e-6), expected, atol=1e-5)


def test_pair_json_keeps_convert_facts(built: tuple[TinyPair, Path]) -> None:
    _, out = built
    converted = json.loads((out.parent / "convert" / "pair.json").read_text())
    injected = json.loads((out / "pair.json").read_text())
    assert injected == {**converted, "fc_scale": injected["fc_scale"]}
