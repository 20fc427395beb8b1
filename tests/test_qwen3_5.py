"""Qwen3.5 targets (hybrid linear attention) end to end: tiny random pairs in both checkpoint layouts, built
by the real pipeline, against Hugging Face's own `generate`; the rolled-back states against HF's cache.

Prompts run from 1 token to past several prefill chunks (8 tokens here) and blocks (4), so calls cross
every boundary, and half of them repeat themselves so lookup and the hybrid propose long runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines import assert_every_mode_equals_hf, assert_sampling_same_seed, mixed_prompts, prefix_and_static
from tests.fixtures.tiny_pairs import make_pair

NEW_TOKENS = 20
MODES = ("plain", "dflash", "lookup", "hybrid")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_text"])
def built(request, tmp_path_factory):
    """(engines, Hugging Face model) of a tiny Qwen3.5 pair, multimodal layout or text-only layout: the
    engine as built (ONNX Runtime's prefix-cache graphs) and one on the static graphs (what QAIC gets)."""
    root = tmp_path_factory.mktemp(request.param)
    prefix, static, hf = prefix_and_static(make_pair(root / "pair", request.param), root / "build")
    yield (prefix, static), hf
    for engine in (prefix, static):
        engine.release_artifacts()


@pytest.mark.slow
def test_every_mode_equals_hf_generate(built) -> None:
    engines, hf = built
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    forms = dict(zip(("prefix", "static"), engines))
    assert_every_mode_equals_hf(forms, hf, mixed_prompts(hf.config.vocab_size), NEW_TOKENS, MODES)


@pytest.mark.slow
def test_sampling_same_seed_equals_plain(built) -> None:
    (engine, _), hf = built
    assert_sampling_same_seed(engine, hf.config.vocab_size, MODES)


@pytest.mark.slow
def test_export_validated_a_rollback_call(built) -> None:
    """The export stage ran a verify after a partly rejected one through ONNX Runtime and PyTorch."""
    import json

    (engine, _), _ = built
    report = json.loads((engine.export_dir / "validation.json").read_text())
    calls = {c["call"] for c in report["checks"] if c["graph"] == "target"}
    assert "verify(2 accepted)" in calls and report["mode"] == "full"
    assert all(c["ok"] for c in report["checks"])


# --- rolled-back states against Hugging Face's cache (PyTorch modules, fp32) ---------------------------------

BLOCK, PROMPT = 8, 13


@pytest.fixture(scope="module")
def modules():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from dflash_cli.modeling.hybrid_target import HybridCacheTarget
    from tests.fixtures.tiny_pairs import _qwen3_5_noise

    text = dict(
        vocab_size=200, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )  # fmt: skip
    cfg = Qwen3_5TextConfig(**text)
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(cfg).eval()
    _qwen3_5_noise(hf, 0)
    ours = HybridCacheTarget(cfg, [1, 3], emit_logits=True, longest_call=16, keep_rows=BLOCK).eval()
    ours.load_state_dict(hf.state_dict(), strict=False)
    return hf, ours


def _hf_states(hf, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(ids, cache=cache, use_cache=True)
    return {
        i: (cache.layers[i].conv_states[0][..., 1:], cache.layers[i].recurrent_states[0])
        for i, kind in enumerate(hf.config.layer_types)
        if kind == "linear_attention"
    }


@pytest.mark.parametrize("accepted", range(BLOCK))
@torch.no_grad()
def test_states_after_a_partly_accepted_verify_equal_hf(modules, accepted: int) -> None:
    """Prefill, a verify of BLOCK tokens of which the first `accepted` + 1 are committed (the loop always
    commits the verify's first token), then the next call: the states it starts from are HF's after
    exactly those tokens, and so are its logits."""
    hf, ours = modules
    gen = torch.Generator().manual_seed(accepted)
    ids = torch.randint(0, 200, (1, PROMPT + BLOCK + 1), generator=gen)
    past = ours.empty_cache(64)
    out = ours(ids[:, :PROMPT], torch.arange(PROMPT)[None], *past)
    past = list(out[3:])
    out = ours(ids[:, PROMPT : PROMPT + BLOCK], torch.arange(PROMPT, PROMPT + BLOCK)[None], *past)
    past = list(out[3:])
    committed = PROMPT + accepted + 1
    nxt = ours(ids[:, committed : committed + 1], torch.tensor([[committed]]), *past)
    names = ours.io_names()[1][3:]
    retained = dict(zip(names, nxt[3:]))
    for layer, (conv, rec) in _hf_states(hf, ids[:, :committed]).items():
        torch.testing.assert_close(retained[f"past_conv.{layer}_RetainedState"], conv, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(retained[f"past_recurrent.{layer}_RetainedState"], rec, rtol=1e-5, atol=1e-6)
    want = hf(ids[:, : committed + 1]).logits[:, -1]
    torch.testing.assert_close(nxt[1][:, 0], want, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_first_call_ignores_whatever_the_state_buffers_held(modules) -> None:
    """An accelerator's retained buffers start as anything: NaN state at position 0 changes nothing."""
    _, ours = modules
    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(1))
    clean = ours(ids, torch.arange(8)[None], *ours.empty_cache(64))
    dirty = [t.fill_(float("nan")) if t.is_floating_point() else t.fill_(3) for t in ours.empty_cache(64)]
    got = ours(ids, torch.arange(8)[None], *dirty)
    torch.testing.assert_close(got[1], clean[1])
    assert torch.equal(got[0], clean[0])


@pytest.mark.slow
def test_qaic_bundle_lists_the_linear_states_as_retained_buffers(built, tmp_path) -> None:
    import json

    from dflash_cli.qaic.bundle import emit_bundle
    from dflash_cli.qaic.command import QaicCompileOptions

    (engine, _), _ = built
    bundle = emit_bundle(engine.export_dir, tmp_path / "bundle", QaicCompileOptions(mxint8_kv_cache=True))
    custom_io = (bundle / "target" / "custom_io.yaml").read_text()
    for name in ("past_conv.0", "past_recurrent.0", "past_delta.0", "past_conv.0_RetainedState"):
        assert f"- IOName: {name}\n  Precision: float16\n" in custom_io
    assert "- IOName: past_key.3\n  Precision: mxint8\n" in custom_io
    assert "past_delta_positions" not in custom_io  # int64: keeps its type on the device
    specs = json.loads((bundle / "target" / "specializations.json").read_text())["specializations"]
    assert sorted(int(s["symbols"]["seq_len"]) for s in specs) == [1, 4, 8]
    assert "target_prefix.onnx" not in (bundle / "compile.sh").read_text()
