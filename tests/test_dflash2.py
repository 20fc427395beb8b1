"""DFlash2 drafts (grouped convolution + candidate selector) through the whole pipeline: lossless greedy and
same-seed sampled output, per-step proposals equal to an independent eager reading of the published model,
and the refusals of what we do not compute."""

from __future__ import annotations

import json

import pytest

from tests.engines import mixed_prompts, open_engine
from tests.fixtures.tiny_dflash2 import make_dflash2_pair

MAX_NEW = 20
CTX_LEN = 128  # the tiny pairs' recipes


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def v2(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"dflash2_{request.param}")
    # the Llama pair's draft has the published sliding window in every layer, as long as the build's ctx_len
    # and transforms its logits before the selector (softcap small enough to change this tiny model's scores)
    extra = None
    if request.param == "llama":
        extra = {"layer_types": ["sliding_attention"] * 2, "sliding_window": CTX_LEN}
        extra["dflash_config"] = {"output_multiplier": 2.0, "final_logit_softcapping": 0.5}
    pair = make_dflash2_pair(root / "pair", request.param, extra=extra)
    return pair, open_engine(pair, root / "build", export={"logits": True})  # logits: sampling


def test_greedy_and_sampled_equal_plain(v2):
    _, engine = v2
    for i, prompt in enumerate(mixed_prompts(engine.tokenizer.vocab_size, n=30)):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=MAX_NEW)
        dflash = engine.generate(prompt, mode="dflash", max_new_tokens=MAX_NEW)
        assert dflash.tokens == plain.tokens, f"prompt {i}: greedy DFlash2 differs from plain"
        if i % 3 == 0:
            sampled = dict(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=i)
            want = engine.generate(prompt, mode="plain", **sampled).tokens
            assert engine.generate(prompt, mode="dflash", **sampled).tokens == want, f"prompt {i}: sampled"


def test_proposals_equal_eager_reference_and_the_selector_matters(v2):
    from tests.reference_dflash import EagerDraft, reference_generate
    from tests.test_reference_parity import run_toolchain

    pair, engine = v2
    layer_ids = json.loads((engine.export_dir / "pair.json").read_text())["target_layer_ids"]
    changed = steps = 0
    plain_select = EagerDraft._select
    for i, prompt in enumerate(mixed_prompts(engine.tokenizer.vocab_size, n=30, seed=11)):
        ours, our_props = run_toolchain(engine, prompt, 10)
        ref_tokens, ref_props, ref_acc = reference_generate(
            pair.target_dir, pair.draft_dir, prompt, 10, set(engine.eos_token_ids), layer_ids
        )
        assert our_props == ref_props, f"prompt {i}"
        assert ours.tokens == ref_tokens and ours.accept_lengths == ref_acc, f"prompt {i}"
        if i % 5:
            continue
        try:  # the same steps with each position's argmax instead of the selector's walk
            EagerDraft._select = lambda self, hidden, logits, anchor: logits.argmax(-1).tolist()
            _, argmax_props, _ = reference_generate(
                pair.target_dir, pair.draft_dir, prompt, 10, set(engine.eos_token_ids), layer_ids
            )
        finally:
            EagerDraft._select = plain_select
        for a, b in zip(ref_props, argmax_props):
            steps += 1
            changed += a != b
    assert changed > 0, f"the selector chose each position's argmax in all {steps} steps: the test would not see it"


def test_export_validation_passed(v2):
    _, engine = v2
    checks = json.loads((engine.export_dir / "validation.json").read_text())
    draft = [c for c in checks["checks"] if c["graph"] == "draft"]
    assert checks["mode"] == "full" and any(c["output"] == "draft_tokens" for c in draft)
    assert all(c["ok"] for c in draft)


def _refused(tmp_path, extra=None, drop=(), **recipe):
    from safetensors.torch import load_file, save_file

    from tests.engines import build_recipe

    pair = make_dflash2_pair(tmp_path / "pair", "qwen3", extra=extra)
    if drop:
        path = pair.draft_dir / "model.safetensors"
        save_file({k: v for k, v in load_file(str(path)).items() if k not in drop}, str(path))
    build_recipe(pair, tmp_path / "build", **recipe)


def test_refuses_a_field_it_does_not_compute(tmp_path):
    from dflash_cli.errors import CheckpointError

    with pytest.raises(CheckpointError, match="attention_modes"):
        _refused(tmp_path, extra={"dflash_config": {"attention_modes": ["kda", "gqa"]}})


def test_refuses_a_selector_missing_from_the_weights(tmp_path):
    from dflash_cli.errors import CheckpointError

    with pytest.raises(CheckpointError, match="missing.*candidate_selector"):
        _refused(tmp_path, drop={"candidate_selector.successor_codebook"})


def test_refuses_a_window_that_would_bind(tmp_path):
    from dflash_cli.errors import RecipeError

    window = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 64}
    with pytest.raises(RecipeError, match="sliding window of 64.*ctx_len 128"):
        _refused(tmp_path, extra=window)


def test_qaic_bundle_takes_the_selector(tmp_path):
    """`dflash compile --backend qaic --emit-script` on a DFlash2 pair: the draft graph passes the QAIC op check
    (the selector's TopK, Gather and ArgMax, the softcap without Tanh) and keeps its static shapes."""
    import onnx

    from tests.engines import dflash_ok

    extra = {"dflash_config": {"final_logit_softcapping": 0.5}}
    pair = make_dflash2_pair(tmp_path / "pair", "qwen3", extra=extra)
    recipe = str(pair.write_recipe(tmp_path / "recipe.yaml", export={"dtype": "fp16"}, compile={"backend": "qaic"}))
    bundle = tmp_path / "bundle"
    dflash_ok("compile", "-r", recipe, "--cache-dir", str(tmp_path / "cache"), "--emit-script", str(bundle))
    graph = onnx.load(str(bundle / "draft.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert "TopK" in ops and "Tanh" not in ops
    tokens = next(o for o in graph.output if o.name == "draft_tokens")
    assert [d.dim_value for d in tokens.type.tensor_type.shape.dim] == [1, pair.block_size - 1]
    from dflash_cli.readiness import readiness_report

    export_dir = next((tmp_path / "cache").glob("artifacts/export/*/export.json")).parent
    draft = next(g for g in readiness_report(export_dir).graphs if g.graph == "draft")
    assert not draft.unsupported_ops and all(s.static for s in draft.shapes), draft


def test_batched_proposals_equal_each_request_alone(v2):
    """Served together (one draft call for several sequences), every request decodes as it does alone and
    the draft calls really carried several sequences (the selector walks each row from its own anchor)."""
    from tests.test_batching import run_together

    _, engine = v2
    prompts = mixed_prompts(engine.tokenizer.vocab_size, n=16, seed=5)
    alone = [engine.generate(p, mode="dflash", max_new_tokens=MAX_NEW).tokens for p in prompts]
    together, batcher = run_together(engine, prompts, mode="dflash", max_new_tokens=MAX_NEW)
    assert [r.tokens for r in together] == alone
    assert batcher.stats.mean("draft") > 1.0


@pytest.mark.parametrize("precision", ["int4", "fp16"])
def test_quantised_and_half_builds_stay_lossless(tmp_path, precision):
    """The selector's scores stay float32 in an fp16 graph; an int4 build quantises the draft's layers and
    keeps the codebooks whole (gathered rows, not a MatMul)."""
    pair = make_dflash2_pair(tmp_path / "pair", "qwen3", seed=3)
    opts = {"compile": {"ort": {"precision": "int4"}}} if precision == "int4" else {"export": {"dtype": "fp16"}}
    engine = open_engine(pair, tmp_path / "build", **opts)
    for i, prompt in enumerate(mixed_prompts(engine.tokenizer.vocab_size, n=12, seed=4)):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=16).tokens
        assert engine.generate(prompt, mode="dflash", max_new_tokens=16).tokens == plain, f"prompt {i}"
