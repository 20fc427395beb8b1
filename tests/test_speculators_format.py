"""Drafts in vLLM speculators' format: the same draft saved that way builds and decodes exactly as its z-lab
form (same proposals, same acceptance), and what we do not compute is refused by name at convert."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.tiny_pairs import make_pair

LAYER_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
)


def as_speculators(zlab_dir: Path, out_dir: Path, **fields) -> Path:
    """The z-lab draft at zlab_dir saved as speculators saves a DFlash draft (config and an extra tensor)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(zlab_dir, out_dir)
    z = json.loads((zlab_dir / "config.json").read_text())
    layer = {"model_type": "qwen3", **{k: z[k] for k in LAYER_FIELDS if k in z}}
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": "test",
        "transformer_layer_config": layer,
        "block_size": z["block_size"],
        "mask_token_id": z["dflash_config"]["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in z["dflash_config"]["target_layer_ids"]],
        "draft_vocab_size": z["vocab_size"],
        "sliding_window_non_causal": False,
        "projector_type": "dflash",
        **fields,
    }
    if z.get("architectures") == ["DFlash2DraftModel"]:  # speculators' DFlash2: its fields at the top level
        cfg |= {"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"]}
        cfg |= {k: v for k, v in z["dflash_config"].items() if k.startswith(("conv_", "selector_"))}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(str(zlab_dir / "model.safetensors"))
    tensors["verifier_norm.weight"] = torch.ones(z["hidden_size"])
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from dataclasses import replace

    root = tmp_path_factory.mktemp("speculators")
    zlab = make_pair(root / "pair", "qwen3")
    spec = replace(zlab, draft_dir=as_speculators(zlab.draft_dir, root / "speculators-draft"))
    return zlab, spec


def test_decodes_exactly_as_its_zlab_form(pairs, tmp_path):
    from tests.engines import open_engine

    zlab, spec = pairs
    # Whole-block verifies: the chosen verify lengths follow timing, and this compares steps one to one.
    a, b = (open_engine(p, tmp_path / d, run={"verify": "block"}) for p, d in ((zlab, "zlab"), (spec, "spec")))
    rng = np.random.default_rng(3)
    for n in (2, 9, 21, 33):
        prompt = list(map(int, rng.integers(2, a.tokenizer.vocab_size, size=n)))
        ra = a.generate(prompt, mode="dflash", max_new_tokens=16)
        rb = b.generate(prompt, mode="dflash", max_new_tokens=16)
        assert rb.tokens == ra.tokens == a.generate(prompt, mode="plain", max_new_tokens=16).tokens
        assert rb.accept_lengths == ra.accept_lengths
    resolved = json.loads(next((tmp_path / "spec").glob("cache/artifacts/convert/*/draft/config.json")).read_text())
    zlab_ids = json.loads((zlab.draft_dir / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert resolved["dflash_config"]["target_layer_ids"] == zlab_ids  # hidden-state indices less one


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"projector_type": "domino"}, "projector_type 'domino'"),
        ({"draft_vocab_size": 64}, "reduced draft vocabulary"),
        ({"sample_from_anchor": True}, "sample_from_anchor"),
        ({"aux_hidden_state_layer_ids": [0, 2]}, "aux_hidden_state_layer_ids"),
        ({"speculators_model_type": "eagle3"}, "speculators 'eagle3' model"),
        ({"use_target_norm": True}, "speculators DFlash draft has use_target_norm True"),
        ({"selector_temperature": 0.7}, "selector_temperature 0.7"),  # a DFlash2 knob, on a DFlash draft
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_refuses_what_it_does_not_compute(pairs, tmp_path, fields, named):
    from dataclasses import replace

    from dflash_cli.errors import CheckpointError
    from tests.engines import build_recipe

    zlab, _ = pairs
    spec = replace(zlab, draft_dir=as_speculators(zlab.draft_dir, tmp_path / "draft", **fields))
    with pytest.raises(CheckpointError, match=named):
        build_recipe(spec, tmp_path / "build")


def test_refuses_layers_causal_within_the_block(pairs, tmp_path):
    from dataclasses import replace

    from dflash_cli.errors import CheckpointError
    from tests.engines import build_recipe

    zlab, _ = pairs
    draft = as_speculators(zlab.draft_dir, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["transformer_layer_config"] |= {"layer_types": ["sliding_attention"] * 2, "sliding_window": 2048}
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="causal within the block"):
        build_recipe(replace(zlab, draft_dir=draft), tmp_path / "build")


@pytest.mark.parametrize(
    ("layer", "named"),
    [
        ({"model_type": "llama"}, "'llama' layers"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_target_norm": True}, "use_target_norm True"),
    ],
)
def test_refuses_layers_it_does_not_compute(pairs, tmp_path, layer, named):
    from dataclasses import replace

    from dflash_cli.errors import CheckpointError
    from tests.engines import build_recipe

    zlab, _ = pairs
    draft = as_speculators(zlab.draft_dir, tmp_path / "draft")
    cfg = json.loads((draft / "config.json").read_text())
    cfg["transformer_layer_config"] |= layer
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=named):
        build_recipe(replace(zlab, draft_dir=draft), tmp_path / "build")


def test_a_dflash2_draft_decodes_exactly_as_its_published_form(tmp_path):
    from dataclasses import replace

    from tests.engines import open_engine
    from tests.fixtures.tiny_dflash2 import make_dflash2_pair

    v2 = make_dflash2_pair(tmp_path / "pair", "qwen3", seed=1)
    spec = replace(v2, draft_dir=as_speculators(v2.draft_dir, tmp_path / "speculators-draft"))
    # Whole-block verifies: the chosen verify lengths follow timing, and this compares steps one to one.
    a, b = (open_engine(p, tmp_path / d, run={"verify": "block"}) for p, d in ((v2, "v2"), (spec, "spec")))
    rng = np.random.default_rng(4)
    for n in (3, 12, 26):
        prompt = list(map(int, rng.integers(2, a.tokenizer.vocab_size, size=n)))
        ra, rb = (e.generate(prompt, mode="dflash", max_new_tokens=16) for e in (a, b))
        assert rb.tokens == ra.tokens and rb.accept_lengths == ra.accept_lengths


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"selector_temperature": 0.7}, "speculators DFlash2 draft has selector_temperature 0.7"),
        ({"use_target_norm": True}, "use_target_norm True"),
    ],
)
def test_a_dflash2_draft_refuses_what_it_does_not_compute(tmp_path, fields, named):
    """Its z-lab form refuses these in dflash_config; at a speculators config's top level they must not be dropped."""
    from dataclasses import replace

    from dflash_cli.errors import CheckpointError
    from tests.engines import build_recipe
    from tests.fixtures.tiny_dflash2 import make_dflash2_pair

    v2 = make_dflash2_pair(tmp_path / "pair", "qwen3")
    spec = replace(v2, draft_dir=as_speculators(v2.draft_dir, tmp_path / "draft", **fields))
    with pytest.raises(CheckpointError, match=named):
        build_recipe(spec, tmp_path / "build")


def test_a_dflash2_drafts_logit_transforms_are_computed():
    """output_multiplier and final_logit_softcapping at a speculators DFlash2 config's top level reach the
    selector as they do from a z-lab dflash_config."""
    from dflash_cli.modeling.dflash2_config import spec_of
    from dflash_cli.pairing.speculators import as_zlab

    layer = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 400}
    cfg = {"speculators_model_type": "dflash2", "transformer_layer_config": layer, "aux_hidden_state_layer_ids": [2, 3]}
    spec = spec_of(as_zlab(cfg | {"output_multiplier": 0.5, "final_logit_softcapping": 20.0}, "config.json"))
    assert (spec.output_multiplier, spec.softcap) == (0.5, 20.0)
    plain = spec_of(as_zlab(cfg, "config.json"))
    assert (plain.output_multiplier, plain.softcap) == (1.0, None)
