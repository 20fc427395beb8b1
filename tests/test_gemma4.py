"""Gemma 4 targets (the dense 31B layout, small): sliding-window and global layers of different head
widths and KV heads, values from the keys' projection, proportional RoPE, soft-capped logits, layer
scalars. Both checkpoint layouts (Gemma4ForConditionalGeneration's text path on text prompts, and
Gemma4ForCausalLM) through the real pipeline, against Hugging Face's own `generate`."""

from __future__ import annotations

import json

import pytest

from tests.engines import assert_every_mode_equals_hf, assert_sampling_same_seed, mixed_prompts, prefix_and_static
from tests.fixtures.tiny_pairs import make_pair

NEW_TOKENS = 20
MODES = ("plain", "dflash", "lookup", "hybrid")


@pytest.fixture(scope="module", params=["gemma4", "gemma4_text"])
def built(request, tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp(request.param)
    pair = make_pair(root / "pair", request.param)
    hf_class = transformers.Gemma4ForConditionalGeneration if request.param == "gemma4" else None
    prefix, static, hf = prefix_and_static(pair, root / "build", hf_class)
    yield (prefix, static), hf
    for engine in (prefix, static):
        engine.release_artifacts()


@pytest.mark.slow
def test_every_mode_equals_hf_generate(built) -> None:
    """32 prompts of 1 to 45 tokens (past the 8-token window), both graph forms, every mode."""
    engines, hf = built
    forms = dict(zip(("prefix", "static"), engines))
    assert_every_mode_equals_hf(forms, hf, mixed_prompts(300, 32), NEW_TOKENS, MODES)


@pytest.mark.slow
def test_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), _ = built
    assert_sampling_same_seed(engine, 300, MODES)


@pytest.mark.slow
def test_export_traced_every_layer_and_validated_against_hf(built) -> None:
    (engine, _), _ = built
    report = json.loads((engine.export_dir / "validation.json").read_text())
    hf_checks = [c for c in report["checks"] if c["call"] == "vs-huggingface"]
    # logits too: sampling reads them, and only they show the soft cap (the argmax does not move)
    assert {c["output"] for c in hf_checks} == {"tokens", "context_features", "logits"}
    assert all(c["ok"] for c in hf_checks)
    graphs = json.loads((engine.export_dir / "export.json").read_text())["graphs"]
    assert graphs["target"]["num_layers"] == 6


def test_variants_computing_what_we_do_not_are_refused_at_convert(tmp_path) -> None:
    from dflash_cli.errors import CheckpointError
    from dflash_cli.stages.convert import describe

    pair = make_pair(tmp_path / "pair", "gemma4_text")
    cfg_path = pair.target_dir / "config.json"
    base = json.loads(cfg_path.read_text())
    for field, value, named in (
        ("hidden_size_per_layer_input", 256, "per-layer input embeddings"),
        ("num_kv_shared_layers", 2, "num_kv_shared_layers"),
        ("enable_moe_block", True, "mixture-of-experts block"),
    ):
        cfg_path.write_text(json.dumps(base | {field: value}))
        with pytest.raises(CheckpointError, match=named):
            describe(pair.recipe())


def test_draft_embeds_through_the_scaled_embedding(tmp_path) -> None:
    """The draft embeds its block with the target's table, which Gemma 4 scales by sqrt(hidden) in the
    checkpoint's dtype: convert writes that scale into the draft's config."""
    from dflash_cli.modeling.gemma4_target import embed_scale
    from dflash_cli.stages.convert import _resolved_draft_config, describe

    pair = make_pair(tmp_path / "pair", "gemma4")
    described = describe(pair.recipe())
    cfg = _resolved_draft_config(described.draft_cfg, described.pair, described.target_cfg)
    assert cfg["embed_scale"] == 8.0  # sqrt(64)
    assert embed_scale(5376, "bfloat16") == 73.5  # the 31B's sqrt(5376) = 73.32, as bf16 holds it


def test_validation_reference_scales_the_embedding_as_the_checkpoints_dtype_does() -> None:
    """Hugging Face running a bf16 checkpoint multiplies by bf16(sqrt(hidden)); validation's float32 reference
    must too, or a real-width export 'differs' from it by the 0.25% rounding (found on the 31B slice)."""
    import torch
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextScaledWordEmbedding

    from dflash_cli.exporting.hf_reference import scale_embeddings_as_checkpoint

    embedding = Gemma4TextScaledWordEmbedding(8, 5376, 0, embed_scale=5376**0.5)
    scale_embeddings_as_checkpoint(embedding, torch.bfloat16)
    assert float(embedding.embed_scale) == 73.5
    scale_embeddings_as_checkpoint(embedding, "float32")
    assert float(embedding.embed_scale) == float(torch.tensor(5376**0.5))
