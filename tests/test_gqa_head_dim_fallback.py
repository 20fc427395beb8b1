"""A target whose head_dim ONNX Runtime's GroupQueryAttention refuses builds with the exported attention.

With RoPE inside (do_rotary=1) the kernel needs head_dim % 16 == 0 and only says so at the first run. The
compile stage checks that before rewriting (ortcompile/gqa.py) and, should ONNX Runtime still refuse the
fused graph, rewrites it again without GroupQueryAttention; either way the build says why and decoding
stays lossless.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from dflash_cli.ortcompile import gqa

pytestmark = pytest.mark.slow  # builds a pair: left out of `make test-fast`

HEAD_DIM = 24  # 4 query heads, 2 KV heads: a multiple of 8, not of 16


@pytest.fixture(scope="module")
def head_dim_24(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3 pair with head_dim 24, built with fuse_attention on (the default)."""
    from dflash_cli.cache.store import Cache
    from dflash_cli.recipe.schema import load_recipe
    from tests.fixtures.tiny_pairs import TinyPair, _token_id, write_dflash_draft, write_qwen3_target

    root = tmp_path_factory.mktemp("head_dim_24")
    target = write_qwen3_target(root / "target", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=HEAD_DIM)
    draft = write_dflash_draft(root / "draft", target, layers=1, block_size=4)
    pair = TinyPair("qwen3", target, draft, 4, _token_id(target, "<|mask|>"))
    recipe = load_recipe(str(pair.write_recipe(root / "recipe.yaml")))
    assert recipe.compile.ort.fuse and recipe.compile.ort.fuse_attention
    return SimpleNamespace(recipe=recipe, cache=Cache(root / "cache"))


def _build(built, rebuild=frozenset()):
    """Build (or rebuild) the pair; (compile.json facts, the compile stage's progress lines, compile dir)."""
    from dflash_cli.stages.pipeline import build

    lines: list[str] = []

    def progress(event) -> None:
        if event.stage == "compile" and event.kind == "message":
            lines.append(event.message)

    result = build(built.recipe, built.cache, rebuild=rebuild, progress=progress)
    compile_dir = result.path("compile")
    return json.loads((compile_dir / "compile.json").read_text()), lines, compile_dir


def _assert_lossless(built) -> None:
    from dflash_cli.backends.ort_prefix import OrtPrefixSession
    from dflash_cli.decoding.engine import Engine

    engine = Engine.load(built.recipe, built.cache)
    assert isinstance(engine.target, OrtPrefixSession)  # host-stored K/V: the exported attention
    rng = np.random.default_rng(3)
    vocab = engine.tokenizer.vocab_size
    for n in (1, 5, 11, 19):  # around the prefill chunk (8) and the block (4)
        prompt = [int(t) for t in rng.integers(2, vocab, size=n)]
        plain = engine.generate(prompt, mode="plain", max_new_tokens=16)
        dflash = engine.generate(prompt, mode="dflash", max_new_tokens=16)
        assert dflash.tokens == plain.tokens, f"prompt of {n}: dflash differs from plain"


def _attention_ops(compile_dir) -> int:
    model = onnx.load(str(compile_dir / "target_prefix.onnx"), load_external_data=False)
    return sum(n.op_type == "GroupQueryAttention" for n in model.graph.node)


def test_the_rewrite_checks_the_head_dim_first_and_the_build_says_why(head_dim_24) -> None:
    facts, lines, compile_dir = _build(head_dim_24)
    why = f"GroupQueryAttention needs head_dim % 16 == 0; this model has {HEAD_DIM}"
    assert facts["prefix_attention"] == f"unfused ({why})"
    assert facts["target_prefix_fused"]["attention"] == 0
    assert facts["target_prefix_fused"]["skipped"] == [f"attention: {why}"]
    assert facts["target_prefix_fused"]["rmsnorm"] > 0  # the other rewrites still apply
    assert any(line.startswith("note:") and why in line for line in lines), lines
    assert _attention_ops(compile_dir) == 0
    assert facts["target_prefix_max_diff"]["tokens"] == 0.0
    _assert_lossless(head_dim_24)


def test_a_refused_fused_graph_falls_back_to_the_exported_attention(head_dim_24, monkeypatch) -> None:
    """The second net: a rewrite ONNX Runtime refuses when the compile stage first runs it."""
    _build(head_dim_24)  # export built once, shared
    monkeypatch.setattr(gqa, "ROTARY_HEAD_DIM_MULTIPLE", 8)  # as if the pre-check did not know the rule
    try:
        facts, lines, compile_dir = _build(head_dim_24, rebuild={"compile"})
        assert facts["prefix_attention"].startswith("unfused (ONNX Runtime refused GroupQueryAttention: ")
        assert "multiple of 16" in facts["prefix_attention"]
        assert facts["target_prefix_fused"]["attention"] == 0
        assert any(line.startswith("note:") and "refused" in line for line in lines), lines
        assert _attention_ops(compile_dir) == 0
        _assert_lossless(head_dim_24)
    finally:
        monkeypatch.undo()
        _build(head_dim_24, rebuild={"compile"})  # the artifact as the pre-check builds it, for any later test


def _gqa_runs(head_dim: int, heads: int, kv_heads: int) -> bool:
    """One tiny GroupQueryAttention call (RoPE inside, as ortcompile/gqa.py writes it) on this ONNX Runtime."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    ctx, rows = 8, 2
    f = TensorProto.FLOAT
    feeds = {
        "q": np.ones((1, rows, heads * head_dim), np.float32),
        "k": np.ones((1, rows, kv_heads * head_dim), np.float32),
        "v": np.ones((1, rows, kv_heads * head_dim), np.float32),
        "past_key": np.zeros((1, kv_heads, ctx, head_dim), np.float32),
        "past_value": np.zeros((1, kv_heads, ctx, head_dim), np.float32),
        "seqlens_k": np.array([rows - 1], np.int32),
        "total_len": np.array(rows, np.int32),
    }
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT32 if a.dtype == np.int32 else f, list(a.shape))
        for name, a in feeds.items()
    ]
    tables = [
        numpy_helper.from_array(np.ones((ctx + 1, head_dim // 2), np.float32), "cos"),
        numpy_helper.from_array(np.zeros((ctx + 1, head_dim // 2), np.float32), "sin"),
    ]
    node = helper.make_node(
        "GroupQueryAttention",
        [*feeds, "cos", "sin"],
        ["out", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        do_rotary=1,
    )
    outputs = [helper.make_tensor_value_info(n, f, None) for n in node.output]
    graph = helper.make_graph([node], "gqa", inputs, outputs, tables)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9)
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("head_dim", [16, 24, 32, 40, 48, 64, 72, 80, 96, 128])
def test_the_pre_check_is_what_this_onnx_runtime_accepts(head_dim: int) -> None:
    assert (gqa.kernel_refusal(head_dim, 4, 2) is None) == _gqa_runs(head_dim, 4, 2)


def test_the_pre_check_knows_the_heads_rule() -> None:
    assert gqa.kernel_refusal(64, 6, 4) is not None and not _gqa_runs(64, 6, 4)
    assert gqa.kernel_refusal(64, 6, 3) is None and _gqa_runs(64, 6, 3)
