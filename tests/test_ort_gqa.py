"""The compile stage's attention rewrite (ortcompile/gqa.py): GroupQueryAttention with the KV cache in place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from dflash_cli.backends.ort_kv_inplace import OrtInPlaceKvSession, is_in_place_graph
from dflash_cli.errors import BackendError, DFlashError
from dflash_cli.ortcompile.fuse import fuse_graph, model_ops


@pytest.mark.parametrize("engine_name", ["qwen3_engine", "llama_engine"])
def test_the_compiled_target_runs_group_query_attention(engine_name, request) -> None:
    engine = request.getfixturevalue(engine_name)
    facts = json.loads((engine.compile_dir / "compile.json").read_text())
    fused = facts["target_prefix_fused"]
    assert fused["skipped"] == [] and fused["attention"] > 0
    assert facts["draft_prefix_fused"]["attention"] == 0  # the draft's block attention is not causal
    model = onnx.load(str(engine.compile_dir / "target_prefix.onnx"), load_external_data=False)
    ops = model_ops(model)
    assert ops["GroupQueryAttention"] == fused["attention"]
    assert fused["attention"] == sum(i.name.startswith("past_key.") for i in model.graph.input)  # every layer
    assert "Softmax" not in ops and "Neg" not in ops, ops  # attention and RoPE are all inside the fused op
    assert "prefix_causal_invariance_max_diff" in facts
    assert is_in_place_graph(engine.compile_dir / "target_prefix.onnx")
    assert not is_in_place_graph(engine.export_dir / "target_prefix.onnx")  # the export keeps its form


def test_a_non_contiguous_call_is_refused(qwen3_engine) -> None:
    sess = qwen3_engine.target
    assert isinstance(sess, OrtInPlaceKvSession)
    sess.reset()
    with pytest.raises(BackendError, match="not contiguous"):
        sess.run({"input_ids": np.ones((1, 3), np.int64), "position_ids": np.array([[0, 2, 3]])})
    with pytest.raises(BackendError, match="not contiguous"):  # padding only after the real rows
        sess.run({"input_ids": np.ones((1, 3), np.int64), "position_ids": np.array([[0, -1, 1]])})


def test_a_rewrite_that_computes_differently_is_refused(qwen3_engine, tmp_path: Path) -> None:
    from dflash_cli.backends.ort import OrtSession
    from dflash_cli.ortcompile.checks import matches_reference, reference_outputs

    export = qwen3_engine.export_dir
    for f in export.iterdir():
        if f.suffix in (".onnx", ".data", ".json"):
            shutil.copy(f, tmp_path / f.name)
    info = json.loads((export / "export.json").read_text())
    vocab = json.loads((export / "pair.json").read_text())["vocab_size"]
    result = fuse_graph(tmp_path / "target_prefix.onnx", tmp_path / "gqa.onnx", attention=True)
    assert result.attention > 0 and result.skipped == []
    model = onnx.load(str(tmp_path / "gqa.onnx"), load_external_data=False)
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    next(a for a in gqa.attribute if a.name == "scale").f *= 2.0  # a wrong softmax scale in one layer
    onnx.save(model, str(tmp_path / "broken.onnx"))
    reference = reference_outputs(OrtSession(tmp_path / "target.onnx", "target"), "target", info, vocab)
    ctx = info["ctx_len"]
    good = matches_reference(OrtInPlaceKvSession(tmp_path / "gqa.onnx", "target", ctx), reference, "t")
    assert good["context_features"] < 1e-4 and good["tokens"] == 0.0
    with pytest.raises(DFlashError, match="differs from the exported one"):
        matches_reference(OrtInPlaceKvSession(tmp_path / "broken.onnx", "target", ctx), reference, "t")


def test_static_and_draft_graphs_are_left_alone(qwen3_engine, tmp_path: Path) -> None:
    export = qwen3_engine.export_dir
    for f in export.iterdir():
        if f.suffix in (".onnx", ".data"):
            shutil.copy(f, tmp_path / f.name)
    for graph in ("target", "draft_prefix"):
        result = fuse_graph(tmp_path / f"{graph}.onnx", tmp_path / f"{graph}.gqa.onnx", attention=True)
        assert result.attention == 0 and any("not a prefix-cache target" in s for s in result.skipped), result


def test_fuse_attention_off_keeps_the_host_stored_cache(tiny_qwen3_pair, tmp_path: Path) -> None:
    from dflash_cli.backends.ort_prefix import OrtPrefixSession
    from tests.engines import open_engine

    engine = open_engine(tiny_qwen3_pair, tmp_path, compile={"backend": "ort", "ort": {"fuse_attention": False}})
    assert isinstance(engine.target, OrtPrefixSession)
    assert json.loads((engine.compile_dir / "compile.json").read_text())["target_prefix_fused"]["attention"] == 0
    prompt = [5, 6, 7, 8]
    assert engine.generate(prompt, mode="dflash", max_new_tokens=12).tokens == (
        engine.generate(prompt, mode="plain", max_new_tokens=12).tokens
    )
