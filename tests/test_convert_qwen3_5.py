"""convert on Qwen3.5 checkpoints: the multimodal layout's text path published under causal-LM names (no
weight read or copied, the vision tower and MTP head left unindexed), the text-only layout as it is, and
layer kinds other than full / linear attention refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_cli.checkpoints.weights import WeightStore
from dflash_cli.errors import CheckpointError
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.convert import STAGE
from tests.fixtures.tiny_pairs import TinyPair, make_pair


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_text"])
def pair(request, tmp_path_factory) -> TinyPair:
    return make_pair(tmp_path_factory.mktemp(request.param), request.param)


def _convert(pair: TinyPair, out: Path, **recipe) -> dict:
    return STAGE.run(StageContext(recipe=pair.recipe(**recipe), out_dir=out, inputs={}, progress=lambda _m: None))


def test_text_path_under_causal_lm_names(pair: TinyPair, tmp_path: Path) -> None:
    facts = _convert(pair, tmp_path / "out")
    store = WeightStore.open(tmp_path / "out" / "target")
    names = set(store.refs)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert not any(n.startswith(("model.visual", "model.language_model", "mtp.")) for n in names)
    source = WeightStore.open(pair.target_dir)
    if any(n.startswith("model.language_model.") for n in source.refs):  # the multimodal layout
        ref = store.refs["model.layers.0.linear_attn.A_log"]
        assert ref.key == "model.language_model.layers.0.linear_attn.A_log"  # renamed in the index only
        assert any(n.startswith("model.visual.") for n in source.refs)
    cfg = json.loads((tmp_path / "out" / "target" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and "text_config" not in cfg
    assert cfg["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert facts["weight_files_copied"] == 0
    assert json.loads((tmp_path / "out" / "pair.json").read_text())["family"] == "qwen3_5"


def test_recipe_family_names_the_family(pair: TinyPair, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        _convert(pair, tmp_path / "out", family="qwen3")
    assert "set family: qwen3_5" in str(exc.value.hint)


def test_other_layer_kinds_are_refused(pair: TinyPair, tmp_path: Path) -> None:
    copy = pair.copy_to(tmp_path / "pair")
    path = copy.target_dir / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg.get("text_config", cfg)
    text["layer_types"][1] = "sliding_attention"
    text["sliding_window"] = 32
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as exc:
        _convert(copy, tmp_path / "out")
    message = str(exc.value)
    assert "target layer 1 is 'sliding_attention' (window 32)" in message
    assert "only full and linear attention is supported" in message


def test_a_multimodal_config_without_its_tower_builds_the_text_path(tmp_path: Path) -> None:
    """A checkpoint saved in the multimodal layout but without the vision tower's tensors: no tower to export."""
    from safetensors.torch import load_file, save_file

    copy = make_pair(tmp_path / "src", "qwen3_5").copy_to(tmp_path / "pair")
    for path in copy.target_dir.glob("*.safetensors"):
        tensors = load_file(str(path))
        save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")}, str(path))
    _convert(copy, tmp_path / "out")
    assert not (tmp_path / "out" / "target" / "vision_config.json").exists()
    with_tower = make_pair(tmp_path / "src2", "qwen3_5_images")
    _convert(with_tower, tmp_path / "out2")
    assert (tmp_path / "out2" / "target" / "vision_config.json").is_file()
