"""convert on mixture-of-experts checkpoints (Qwen3-MoE, Qwen3.5-MoE, gpt-oss in both its layouts): the experts
indexed as stacked tensors without a byte copied, read back exactly; incomplete experts and a wrong recipe
family refused; gpt-oss's reasoning effort passed to its chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_cli.checkpoints.weights import WeightStore
from dflash_cli.errors import CheckpointError
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.convert import STAGE
from tests.fixtures.damage import drop_tensor
from tests.fixtures.tiny_pairs import TinyPair, make_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> TinyPair:
    return make_pair(tmp_path_factory.mktemp("moe"), "qwen3_moe_mixed")


def _convert(pair: TinyPair, out: Path, **recipe) -> dict:
    return STAGE.run(StageContext(recipe=pair.recipe(**recipe), out_dir=out, inputs={}, progress=lambda _m: None))


def test_experts_read_as_stacks_of_the_checkpoint(pair: TinyPair, tmp_path: Path) -> None:
    facts = _convert(pair, tmp_path / "out")
    assert facts["weight_files_copied"] == 0
    store = WeightStore.open(tmp_path / "out" / "target")
    # every other layer sparse (decoder_sparse_step 2): layers 1 and 3
    assert sorted(store.stacks) == [
        f"model.layers.{i}.mlp.experts.{w}" for i in (1, 3) for w in ("down_proj", "gate_up_proj")
    ]
    gate_up = store.get("model.layers.1.mlp.experts.gate_up_proj", torch.float32)
    down = store.get("model.layers.3.mlp.experts.down_proj", torch.float32)
    assert tuple(gate_up.shape) == store.shape("model.layers.1.mlp.experts.gate_up_proj") == (8, 64, 64)
    assert tuple(down.shape) == (8, 64, 32)
    raw = load_file(str(pair.target_dir / "model.safetensors"))
    e = "model.layers.1.mlp.experts.5."
    assert torch.equal(gate_up[5, 0::2], raw[e + "gate_proj.weight"].float())  # rows interleaved: gate, up, ...
    assert torch.equal(gate_up[5, 1::2], raw[e + "up_proj.weight"].float())
    assert torch.equal(down[2], raw["model.layers.3.mlp.experts.2.down_proj.weight"].float())
    blocks = list(store.iter_rows("model.layers.1.mlp.experts.gate_up_proj", torch.float32))
    assert len(blocks) == 8 and torch.equal(torch.cat(blocks), gate_up)  # one expert at a time
    assert "model.layers.0.mlp.gate_proj.weight" in store  # the dense layers as they are
    assert json.loads((tmp_path / "out" / "pair.json").read_text())["family"] == "qwen3_moe"


def test_published_config_spelling(pair: TinyPair) -> None:
    """The model cards' configs say `num_experts`; transformers 5 saves `num_local_experts`."""
    from dflash_cli.modeling.moe import sparse_layers

    cfg = json.loads((pair.target_dir / "config.json").read_text())
    published = {k: v for k, v in cfg.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert sparse_layers(cfg) == sparse_layers(published) == [1, 3]
    assert sparse_layers(published | {"mlp_only_layers": [3]}) == [1]


def test_missing_expert_is_refused(pair: TinyPair, tmp_path: Path) -> None:
    copy = pair.copy_to(tmp_path / "pair")
    drop_tensor(copy.target_dir, "model.layers.3.mlp.experts.6.up_proj.weight")
    with pytest.raises(CheckpointError) as exc:
        _convert(copy, tmp_path / "out")
    assert "target layer 3 lacks expert weights" in str(exc.value)
    assert "experts.6.up_proj" in str(exc.value)


def test_recipe_family_names_the_family(pair: TinyPair, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        _convert(pair, tmp_path / "out", family="qwen3")
    assert "set family: qwen3_moe" in str(exc.value.hint)


@pytest.mark.parametrize("layout", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_qwen3_5_moe_experts_and_shared_expert(layout: str, tmp_path: Path) -> None:
    """Qwen3.5-MoE in both layouts: the text path under causal-LM names, every layer's experts stacked, the
    shared expert and its gate as they are."""
    pair = make_pair(tmp_path / "pair", layout)
    _convert(pair, tmp_path / "out")
    store = WeightStore.open(tmp_path / "out" / "target")
    assert len(store.stacks) == 2 * 4  # gate_up and down of every layer
    assert store.shape("model.layers.0.mlp.experts.gate_up_proj") == (8, 64, 64)
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in store
    assert "model.layers.3.mlp.shared_expert_gate.weight" in store
    cfg = json.loads((tmp_path / "out" / "target" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_moe_text"
    assert json.loads((tmp_path / "out" / "pair.json").read_text())["family"] == "qwen3_5_moe"


def test_gpt_oss_mxfp4_experts_read_exactly(tmp_path: Path) -> None:
    """gpt-oss as published (MXFP4 `_blocks` / `_scales`) and as transformers saves the same model: convert reads
    the same expert values from both, in ONNX Runtime's layout ([E, out, in], gate and up rows interleaved)."""
    pair = make_pair(tmp_path / "pair", "gpt_oss_mxfp4")
    reference = WeightStore.open(Path(f"{pair.target_dir}-reference"))
    _convert(pair, tmp_path / "out")
    store = WeightStore.open(tmp_path / "out" / "target")
    assert store.stacks["model.layers.0.mlp.experts.gate_up_proj"].kind == "mxfp4"
    for layer in (0, 3):
        for w in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{w}"
            want = reference.get(name, torch.float32).transpose(1, 2)
            assert torch.equal(store.get(name, torch.float32), want), name
    assert store.shape("model.layers.0.mlp.experts.gate_up_proj") == (8, 64, 64)
    assert json.loads((tmp_path / "out" / "pair.json").read_text())["family"] == "gpt_oss"


def test_gpt_oss_reasoning_effort_reaches_the_chat_template(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from dflash_cli.decoding.engine import Engine

    class Tokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            return f"effort={kwargs.get('reasoning_effort')}|{messages[0]['content']}"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    engine = Engine.__new__(Engine)
    engine.tokenizer = Tokenizer()
    for family, effort, want in (("gpt_oss", "high", "effort=high|hi"), ("gpt_oss", None, "effort=None|hi"),
                                 ("qwen3_moe", "high", "effort=None|hi")):  # fmt: skip
        engine.settings = SimpleNamespace(family=family, reasoning_effort=effort)
        assert "".join(map(chr, engine._templated([{"role": "user", "content": "hi"}], False))) == want
