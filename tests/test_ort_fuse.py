"""The ONNX Runtime compile stage's rewrite: fused norms, no V guard, checked against the export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from dflash_cli.errors import DFlashError
from dflash_cli.ortcompile.fuse import fuse_graph, model_ops


def _ops(path: Path) -> dict[str, int]:
    return model_ops(onnx.load(str(path), load_external_data=False))


def test_compiled_graphs_are_fused_and_checked(qwen3_engine) -> None:
    compiled = qwen3_engine.compile_dir
    facts = json.loads((compiled / "compile.json").read_text())
    assert facts["target_fused"]["skipped"] == [] and facts["draft_fused"]["skipped"] == []
    assert facts["target_fused"]["rmsnorm"] > 0 and facts["target_fused"]["v_guard"] > 0
    assert facts["target_fused_max_diff"]["tokens"] == 0.0 and "draft_fused_max_diff" in facts
    for graph in ("target", "draft"):
        ops = _ops(compiled / f"{graph}.onnx")
        assert ops.get("SimplifiedLayerNormalization", 0) > 0 and "Pow" not in ops, ops
        # the MLP's SiLU is one QuickGelu per layer
        assert ops.get("QuickGelu", 0) == facts[f"{graph}_fused"]["silu"] > 0 and "Sigmoid" not in ops, ops
        assert not list(compiled.glob("*.unfused.onnx"))
    # The export keeps the accelerator-safe forms (the compile stage rewrote its own copy).
    exported = _ops(qwen3_engine.export_dir / "target.onnx")
    assert "SimplifiedLayerNormalization" not in exported and exported["Pow"] > 0


def test_fused_graph_that_computes_differently_is_refused(qwen3_engine, tmp_path: Path) -> None:
    from dflash_cli.backends.ort import OrtSession
    from dflash_cli.ortcompile.checks import matches_reference, reference_outputs

    export = qwen3_engine.export_dir
    for f in export.iterdir():
        if f.suffix in (".onnx", ".data", ".json"):
            shutil.copy(f, tmp_path / f.name)
    fuse_graph(tmp_path / "target.onnx", tmp_path / "fused.onnx")
    model = onnx.load(str(tmp_path / "fused.onnx"), load_external_data=False)
    norm = next(n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    next(a for a in norm.attribute if a.name == "epsilon").f = 10.0  # a wrong epsilon
    onnx.save(model, str(tmp_path / "broken.onnx"))
    info = json.loads((export / "export.json").read_text())
    vocab = json.loads((export / "pair.json").read_text())["vocab_size"]
    reference = reference_outputs(OrtSession(tmp_path / "target.onnx", "target"), "target", info, vocab)
    good = matches_reference(OrtSession(tmp_path / "fused.onnx", "target"), reference, "fused target")
    assert good["context_features"] < 1e-4
    with pytest.raises(DFlashError, match="fused target graph differs"):
        matches_reference(OrtSession(tmp_path / "broken.onnx", "target"), reference, "fused target")


def test_fuse_off_keeps_the_exported_graphs(tiny_qwen3_pair, tmp_path: Path) -> None:
    from tests.engines import build_recipe

    recipe, cache = build_recipe(tiny_qwen3_pair, tmp_path, compile={"backend": "ort", "ort": {"fuse": False}})
    from dflash_cli.stages.pipeline import build

    compiled = build(recipe, cache).path("compile")
    assert "SimplifiedLayerNormalization" not in _ops(compiled / "target.onnx")
    assert "target_fused" not in json.loads((compiled / "compile.json").read_text())
