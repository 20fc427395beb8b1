"""Mixture-of-experts targets end to end, built by the real pipeline, against Hugging Face's own `generate`, in
every mode, on the prefix-cache graphs ONNX Runtime runs and on the static graphs: tiny random Qwen3-MoE pairs
(every layer sparse, and every other layer dense), a Qwen3.5-MoE pair (hybrid linear attention, routed plus
shared experts), a Qwen3-Next pair (the same, its linear-attention projections fused per key head) and gpt-oss
pairs (attention sinks, an 8-token window on every other layer, biased experts; as transformers saves it, and as
published, MXFP4). The experts of a call are computed per token whatever shares the call."""

from __future__ import annotations

import json

import pytest

from tests.engines import assert_every_mode_equals_hf, assert_sampling_same_seed, mixed_prompts, prefix_and_static
from tests.fixtures.tiny_pairs import make_pair

NEW_TOKENS = 20
MODES = ("plain", "dflash", "lookup", "hybrid")


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_moe_mixed", "qwen3_5_moe", "qwen3_next", "gpt_oss"])
def built(request, tmp_path_factory):
    """(engines, Hugging Face model, build root): the engine as built (prefix-cache graphs) and one on the
    static graphs."""
    root = tmp_path_factory.mktemp(request.param)
    prefix, static, hf = prefix_and_static(make_pair(root / "pair", request.param), root / "build")
    yield (prefix, static), hf, root / "build"
    for engine in (prefix, static):
        engine.release_artifacts()


@pytest.mark.slow
def test_every_mode_equals_hf_generate(built) -> None:
    engines, hf, _ = built
    names = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "GptOssForCausalLM")
    assert type(hf).__name__ in names
    forms = dict(zip(("prefix", "static"), engines))
    assert_every_mode_equals_hf(forms, hf, mixed_prompts(hf.config.vocab_size), NEW_TOKENS, MODES)


@pytest.mark.slow
def test_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), hf, _ = built
    assert_sampling_same_seed(engine, hf.config.vocab_size, MODES)


@pytest.mark.slow
def test_build_checked_experts_per_token(built) -> None:
    """The graphs hold ONNX Runtime's MoE op, one per sparse layer, and the build found every output of a row
    the same whatever the call's length (a row alone, in a block, in a long call)."""
    import onnx

    (engine, _), hf, root = built
    facts = json.loads(next((root / "cache" / "artifacts" / "compile").glob("*/compile.json")).read_text())
    from dflash_cli.families import family_for

    hybrid = family_for(hf.config.model_type).hybrid  # its delta rule rounds by call length (README): tokens only
    moved = facts["prefix_call_length_max_diff"]
    assert moved["tokens"] == 0.0 and (hybrid or set(moved.values()) == {0.0})
    assert facts["prefix_causal_invariance_max_diff"]["tokens"] == 0.0
    graph = onnx.load(str(engine.export_dir / "target_prefix.onnx"), load_external_data=False).graph
    moe = [n for n in graph.node if n.op_type == "MoE"]
    from dflash_cli.modeling.moe import sparse_layers

    assert len(moe) == len(sparse_layers(hf.config)) > 0
    report = json.loads((engine.export_dir / "validation.json").read_text())
    assert all(c["ok"] for c in report["checks"])


@pytest.mark.slow
def test_reduced_validation_keeps_fewer_experts(tmp_path, monkeypatch) -> None:
    """A large MoE pair validates a reduced model with its first experts only (memory: most of a layer's bytes
    are experts), grown from the export's own traced layer; a wrongly streamed expert still fails the stage."""
    from dflash_cli.cache.store import Cache
    from dflash_cli.errors import ExportValidationError
    from dflash_cli.exporting import graphs, reduced, validate
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages import export
    from dflash_cli.stages.pipeline import artifact_paths, build

    monkeypatch.setattr(export, "FULL_VALIDATION_BYTES", 0)
    monkeypatch.setattr(reduced, "VOCAB", 300)
    monkeypatch.setattr(reduced, "EXPERTS", 4)  # of 8; a token chooses 2
    traced = []
    monkeypatch.setattr(validate, "_export_reduced", lambda *a: traced.append(a))
    pair = make_pair(tmp_path / "pair", "qwen3_moe")

    def export_only(name: str):
        recipe = load_recipe(str(pair.write_recipe(tmp_path / f"{name}.yaml")))
        cache = Cache(tmp_path / name)
        build(recipe, cache, upto="export")
        return artifact_paths(recipe, cache, ["export"])["export"]

    doc = json.loads((export_only("ok") / "validation.json").read_text())
    assert traced == [] and "at most 4 experts a layer" in doc["mode"]
    assert all(c["ok"] for c in doc["checks"]) and any(c["call"] == "vs-huggingface" for c in doc["checks"])

    real = graphs._reader

    def corrupt(store, key, dtype, cut, shape):
        produce = real(store, key, dtype, cut, shape)
        if key != "model.layers.2.mlp.experts.gate_up_proj":  # a layer the export copied from layer 0
            return produce
        return lambda: (-block[:, ::-1].copy() for block in produce())  # each expert's rows swapped and negated

    monkeypatch.setattr(graphs, "_reader", corrupt)
    with pytest.raises(ExportValidationError, match="export validation failed"):
        export_only("bad")
