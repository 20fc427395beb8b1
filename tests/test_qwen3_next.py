"""Qwen3-Next targets: its Gated DeltaNet projections, fused per key head in the checkpoint, read by convert as
Qwen3.5's four (row views, no copy) and put back exactly for Hugging Face; our Qwen3.5-MoE modules on the views
against Hugging Face's own Qwen3NextForCausalLM (dense layers and norm_topk_prob too); config.json fields left out
read as transformers' defaults. The built pair against `generate` in every mode: tests/test_moe.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dflash_cli.checkpoints.weights import WeightStore
from dflash_cli.errors import CheckpointError
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.convert import STAGE
from tests.fixtures.damage import drop_tensor
from tests.fixtures.tiny_pairs import TinyPair, make_pair

LINEAR = (0, 1, 2)  # the tiny pair's Gated DeltaNet layers (layer 3 is full attention)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> TinyPair:
    return make_pair(tmp_path_factory.mktemp("next"), "qwen3_next")


@pytest.fixture(scope="module")
def converted(pair: TinyPair, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("next-convert")
    _convert(pair, out)
    return out


def _convert(pair: TinyPair, out: Path) -> dict:
    return STAGE.run(StageContext(recipe=pair.recipe(), out_dir=out, inputs={}, progress=lambda _m: None))


def _hf(target_dir: Path):
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()


def _hf_row_order(layer) -> tuple[torch.Tensor, ...]:
    """Row numbers of in_proj_qkvz / in_proj_ba in the order Hugging Face's own split puts them: (qkv, z, b, a),
    found by feeding the row numbers themselves through it."""
    qkvz_rows, ba_rows = layer.in_proj_qkvz.weight.shape[0], layer.in_proj_ba.weight.shape[0]
    numbers = (torch.arange(n, dtype=torch.float64)[None, None] for n in (qkvz_rows, ba_rows))
    q, k, v, z, b, a = layer.fix_query_key_value_ordering(*numbers)
    qkv = torch.cat([y.reshape(-1) for y in (q, k, v)])
    return tuple(y.reshape(-1).long() for y in (qkv, z, b, a))


def test_convert_reads_the_fused_projections_as_qwen3_5s(pair: TinyPair, converted: Path) -> None:
    """Each view is exactly the rows Hugging Face's split takes, in its order, read from the artifact's index."""
    store = WeightStore.open(converted / "target")
    raw = load_file(str(pair.target_dir / "model.safetensors"))
    hf = _hf(pair.target_dir)
    for i in LINEAR:
        p = f"model.layers.{i}.linear_attn."
        order = dict(
            zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), _hf_row_order(hf.model.layers[i].linear_attn))
        )
        for name, rows in order.items():
            fused = raw[p + ("in_proj_ba.weight" if name in ("in_proj_b", "in_proj_a") else "in_proj_qkvz.weight")]
            view = store.get(p + name + ".weight", torch.float32)
            assert store.stacks[p + name + ".weight"].kind == "regroup"
            assert store.shape(p + name + ".weight") == tuple(view.shape) == (len(rows), 64)
            assert torch.equal(view, fused[rows]), (i, name)
            blocks = list(store.iter_rows(p + name + ".weight", torch.float32, rows=5))
            assert torch.equal(torch.cat(blocks), fused[rows[:5]])  # a cut view stops after its first rows
    assert "model.layers.3.linear_attn.in_proj_qkv.weight" not in store  # full attention there


@torch.no_grad()
def test_projections_computed_both_ways_agree(pair: TinyPair, converted: Path) -> None:
    """Qwen3.5's four projections on the views == Hugging Face's Qwen3-Next split of its two fused ones."""
    store = WeightStore.open(converted / "target")
    hf = _hf(pair.target_dir)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
    for i in LINEAR:
        layer, p = hf.model.layers[i].linear_attn, f"model.layers.{i}.linear_attn."
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        want = {
            "in_proj_qkv": torch.cat([y.reshape(2, 7, -1) for y in (q, k, v)], dim=-1),
            "in_proj_z": z.reshape(2, 7, -1),
            "in_proj_b": b,
            "in_proj_a": a,
        }
        for name, expected in want.items():
            got = F.linear(x, store.get(p + name + ".weight", torch.float32))
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_hf_state_fuses_them_back_exactly(pair: TinyPair, converted: Path) -> None:
    from transformers import AutoConfig

    from dflash_cli.families import family_for

    store = WeightStore.open(converted / "target")
    cfg = AutoConfig.from_pretrained(str(converted / "target"))
    state = {n: store.get(n, torch.float32) for n in store.stacks if ".linear_attn." in n}
    back = family_for("qwen3_next").hf_state(state, cfg)
    raw = load_file(str(pair.target_dir / "model.safetensors"))
    assert sorted(back) == sorted(
        f"model.layers.{i}.linear_attn.{w}" for i in LINEAR for w in ("in_proj_ba.weight", "in_proj_qkvz.weight")
    )
    for name, tensor in back.items():
        assert torch.equal(tensor, raw[name]), name


def _ours_from(converted: Path):
    """Our Qwen3.5-MoE hybrid module, its weights read through convert's index (views included)."""
    from dflash_cli.modeling.hybrid_target import HybridCacheTarget
    from dflash_cli.modeling.loading import target_config

    cfg = target_config(converted)
    ours = HybridCacheTarget(cfg, [1, 3], emit_logits=True, longest_call=16, keep_rows=8).eval()
    store = WeightStore.open(converted / "target")
    state = {n: store.get(n, t.dtype) for n, t in ours.state_dict().items() if not n.startswith("dflash.")}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert unexpected == [] and all(n.startswith(("dflash.", "rotary.")) for n in missing), missing
    return ours


@pytest.mark.parametrize("variant", ["published", "dense_layer", "no_topk_renormalise"])
@torch.no_grad()
def test_our_modules_on_the_views_equal_hf(variant: str, tmp_path: Path) -> None:
    """Prefill then one-token calls: our logits == Qwen3NextForCausalLM's, with the published structure, with a
    dense MLP layer (mlp_only_layers), and with norm_topk_prob false."""
    pair = make_pair(tmp_path / "pair", "qwen3_next_mixed" if variant == "dense_layer" else "qwen3_next")
    if variant == "no_topk_renormalise":
        path = pair.target_dir / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"norm_topk_prob": False}))
    _convert(pair, tmp_path / "out")
    ours, hf = _ours_from(tmp_path / "out"), _hf(pair.target_dir)
    if variant == "dense_layer":
        assert not hasattr(ours.model.layers[1].mlp, "experts") and hasattr(ours.model.layers[0].mlp, "experts")
    ids = torch.randint(0, hf.config.vocab_size, (1, 15), generator=torch.Generator().manual_seed(5))
    past = ours.empty_cache(64)
    out = ours(ids[:, :12], torch.arange(12)[None], *past)
    torch.testing.assert_close(out[1], hf(ids[:, :12]).logits, rtol=1e-4, atol=1e-5)
    for t in range(12, 15):
        out = ours(ids[:, t : t + 1], torch.tensor([[t]]), *out[3:])
        torch.testing.assert_close(out[1][:, 0], hf(ids[:, : t + 1]).logits[:, -1], rtol=1e-4, atol=1e-5)


def test_fields_config_json_leaves_out_read_as_transformers_defaults(pair: TinyPair, tmp_path: Path) -> None:
    """The published config.json says full_attention_interval, not layer_types; linear-attention shapes it leaves
    out are Qwen3NextConfig's."""
    from transformers import Qwen3NextConfig

    from dflash_cli.families.qwen3_next import _geometry

    geo = _geometry({"model_type": "qwen3_next", "num_hidden_layers": 8})
    want = Qwen3NextConfig(num_hidden_layers=8)
    assert (geo.k_heads, geo.v_heads, geo.dk, geo.dv) == (
        want.linear_num_key_heads, want.linear_num_value_heads, want.linear_key_head_dim, want.linear_value_head_dim
    )  # fmt: skip
    assert geo.linear_layers == (0, 1, 2, 4, 5, 6)
    copy = pair.copy_to(tmp_path / "pair")
    path = copy.target_dir / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["layer_types"]
    path.write_text(json.dumps(cfg | {"full_attention_interval": 4}))
    _convert(copy, tmp_path / "out")
    store = WeightStore.open(tmp_path / "out" / "target")
    assert sorted(n for n in store.stacks if n.endswith("in_proj_qkv.weight")) == [
        f"model.layers.{i}.linear_attn.in_proj_qkv.weight" for i in LINEAR
    ]


def test_a_missing_fused_projection_is_refused(pair: TinyPair, tmp_path: Path) -> None:
    copy = pair.copy_to(tmp_path / "pair")
    drop_tensor(copy.target_dir, "model.layers.2.linear_attn.in_proj_ba.weight")
    with pytest.raises(CheckpointError) as exc:
        _convert(copy, tmp_path / "out")
    assert "target layer 2 has no in_proj_ba of 8 rows" in str(exc.value)


@pytest.mark.slow
def test_reduced_validation_checks_the_views_against_hf(tmp_path: Path, monkeypatch) -> None:
    """The published model validates a reduced one (first layers, experts, vocabulary rows): the views are read,
    and fused back for Hugging Face's model, at the reduced depth too."""
    from dflash_cli.cache.store import Cache
    from dflash_cli.exporting import reduced
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages import export
    from dflash_cli.stages.pipeline import artifact_paths, build

    monkeypatch.setattr(export, "FULL_VALIDATION_BYTES", 0)
    monkeypatch.setattr(reduced, "VOCAB", 300)
    monkeypatch.setattr(reduced, "EXPERTS", 4)  # of 8; a token chooses 2
    pair = make_pair(tmp_path / "pair", "qwen3_next")
    recipe = load_recipe(str(pair.write_recipe(tmp_path / "recipe.yaml")))
    cache = Cache(tmp_path / "cache")
    build(recipe, cache, upto="export")
    doc = json.loads((artifact_paths(recipe, cache, ["export"])["export"] / "validation.json").read_text())
    assert "at most 4 experts a layer" in doc["mode"]
    assert all(c["ok"] for c in doc["checks"]) and any(c["call"] == "vs-huggingface" for c in doc["checks"])
