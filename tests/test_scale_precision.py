"""fp16 export, weight-only int8/int4 compile, the causal-invariance check and bounded (reduced-model) validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_cli.errors import DFlashError, ExportValidationError
from tests.engines import open_engine
from tests.fixtures.tiny_pairs import TinyPair

pytestmark = pytest.mark.slow  # builds or exports pairs: left out of `make test-fast`

PROMPTS = 8


def _prompts(engine, n: int = PROMPTS, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(2, engine.tokenizer.vocab_size, size=int(k)))) for k in rng.integers(3, 40, n)]


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_weight_only_precisions_stay_lossless(precision: str, family: str, request, tmp_path: Path) -> None:
    pair: TinyPair = request.getfixturevalue(f"tiny_{family}_pair")
    engine = open_engine(pair, tmp_path, compile={"ort": {"precision": precision, "block_size": 16}})
    facts = json.loads((engine.compile_dir / "compile.json").read_text())
    assert facts["precision"] == precision and facts["target_quantized_matmuls"] > 0
    assert facts["checks"].startswith("smoke") and facts["checks"].endswith("causal invariance")
    assert set(facts["causal_invariance_max_diff"].values()) == {0.0}
    import onnx

    ops = {n.op_type for n in onnx.load(str(engine.compile_dir / "target.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
    # q/k/v and gate/up stacked per layer; the prefix-cache target's attention still found through them.
    assert facts["target_stacked_matmuls"] > 0 and facts["target_prefix_fused"]["attention"] > 0
    # ... and its q/k/v padded to two rows once per layer, before the stacked projection's Split
    prefix = onnx.load(str(engine.compile_dir / "target_prefix.onnx"), load_external_data=False)
    layers = facts["target_prefix_fused"]["attention"]
    assert facts["target_prefix_fused"]["row_pads_merged"] == layers
    assert sum(n.op_type == "Pad" for n in prefix.graph.node) == layers
    # The draft's lm_head is the target's tensor: quantised once, the draft points at the target's copy.
    draft = onnx.load(str(engine.compile_dir / "draft.onnx"), load_external_data=False)
    head = next(t for t in draft.graph.initializer if "lm_head" in t.name and t.name.endswith(f".w{precision[-1]}"))
    assert {e.key: e.value for e in head.external_data}["location"] == "target.onnx.q.data"
    # So is the embedding, block-quantised alike (no float table of vocab rows is left in either graph).
    for graph in (onnx.load(str(engine.compile_dir / "target.onnx"), load_external_data=False), draft):
        gather = next(n for n in graph.graph.node if n.op_type == "GatherBlockQuantized")
        table = next(t for t in graph.graph.initializer if t.name == gather.input[0])
        assert {e.key: e.value for e in table.external_data}["location"] == "target.onnx.q.data"
        rows = table.dims[0]
        floats = [t for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and t.dims[:1] == [rows]]
        assert all(t.name.endswith(".scales") for t in floats)  # the lm_head's and the embedding's scales
    # The prefix-cache graphs read the same weights: each quantised tensor, stacked or not, is the first copy.
    for graph in ("target_prefix", "draft_prefix"):
        assert (engine.compile_dir / f"{graph}.onnx.q.data").stat().st_size == 0
    for prompt in _prompts(engine):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=12)
        assert engine.generate(prompt, mode="dflash", max_new_tokens=12).tokens == plain.tokens
        assert engine.generate(prompt, mode="lookup", max_new_tokens=12).tokens == plain.tokens


def test_int4_is_smaller_than_fp32_on_disk(tiny_llama_pair: TinyPair, llama_engine, tmp_path: Path) -> None:
    from dflash_cli.ortcompile.checks import graph_weight_bytes

    e32 = llama_engine  # the pair built with the default (fp32) recipe
    e4 = open_engine(tiny_llama_pair, tmp_path / "int4", compile={"ort": {"precision": "int4"}})
    big = graph_weight_bytes(e32.compile_dir / "target.onnx")
    small = graph_weight_bytes(e4.compile_dir / "target.onnx")
    assert small < 0.5 * big


def test_causal_check_catches_per_call_activation_scales(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    """The old int8 (dynamic quantisation: one activation scale per call) must fail the check."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from dflash_cli.backends.ort import OrtSession
    from dflash_cli.ortcompile.checks import causal_invariance

    engine = open_engine(tiny_qwen3_pair, tmp_path)
    info = json.loads((engine.compile_dir / "export.json").read_text())
    import onnx
    import onnxruntime as ort

    from dflash_cli.exporting.onnx_data import load_with_data

    inline = tmp_path / "inline.onnx"
    onnx.save(load_with_data(engine.compile_dir / "target.onnx"), str(inline))
    folded = tmp_path / "folded.onnx"  # weights pre-transposed, as the old exporter wrote them
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    opts.optimized_model_filepath = str(folded)
    ort.InferenceSession(str(inline), opts, providers=["CPUExecutionProvider"])
    bad = tmp_path / "dynamic.onnx"
    quantize_dynamic(str(folded), str(bad), op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8)
    assert "DynamicQuantizeLinear" in {n.op_type for n in onnx.load(str(bad)).graph.node}
    with pytest.raises(DFlashError, match="not causal"):
        causal_invariance(OrtSession(bad, "target"), info, vocab_size=400)
    good = causal_invariance(OrtSession(engine.compile_dir / "target.onnx", "target"), info, vocab_size=400)
    assert set(good.values()) == {0.0}


def test_fp16_export_runs_and_validates(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    import onnx

    from dflash_cli.stages.pipeline import artifact_paths

    recipe, cache = _export_only(tiny_qwen3_pair, tmp_path, "fp16", export={"dtype": "fp16"})
    export = artifact_paths(recipe, cache, ["export"])["export"]
    model = onnx.load(str(export / "target.onnx"), load_external_data=False)
    kv = next(i for i in model.graph.input if i.name == "past_key.0")
    assert kv.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    fc = next(t for t in model.graph.initializer if t.name.endswith("dflash.fc.weight"))
    assert fc.data_type == onnx.TensorProto.FLOAT16
    validation = json.loads((export / "validation.json").read_text())
    assert validation["mode"] == "full" and all(c["ok"] for c in validation["checks"])
    # half the bytes of the fp32 export of the same pair
    recipe32, cache32 = _export_only(tiny_qwen3_pair, tmp_path, "fp32")  # convert and inject are cached
    export32 = artifact_paths(recipe32, cache32, ["export"])["export"]
    size = (export / "target.onnx.data").stat().st_size
    assert size < 0.6 * (export32 / "target.onnx.data").stat().st_size


def _export_only(pair: TinyPair, root: Path, name: str = "recipe", **overrides):
    """The pair built up to its export, into root/cache."""
    from dflash_cli.cache.store import Cache
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    recipe = load_recipe(str(pair.write_recipe(root / f"{name}.yaml", **overrides)))
    cache = Cache(root / "cache")
    build(recipe, cache, upto="export")
    return recipe, cache


def test_reduced_validation_passes_and_catches_a_bad_weight(tiny_llama_pair: TinyPair, tmp_path: Path, monkeypatch):
    """Large pairs validate a reduced model; it still fails the stage when a weight is streamed wrong."""
    from dflash_cli.exporting import graphs, reduced, validate
    from dflash_cli.stages import export

    monkeypatch.setattr(export, "FULL_VALIDATION_BYTES", 0)
    monkeypatch.setattr(reduced, "VOCAB", 300)
    traced = []  # the reduced model is grown from the export's own traced layers, not traced again
    monkeypatch.setattr(validate, "_export_reduced", lambda *a: traced.append(a))
    recipe, cache = _export_only(tiny_llama_pair, tmp_path / "ok")
    assert traced == []
    from dflash_cli.stages.pipeline import artifact_paths

    export_dir = artifact_paths(recipe, cache, ["export"])["export"]
    doc = json.loads((export_dir / "validation.json").read_text())
    assert doc["mode"].startswith("reduced model: 3 target / 2 draft layers, 300 vocabulary rows")
    assert all(c["ok"] for c in doc["checks"]) and any(c["call"] == "vs-huggingface" for c in doc["checks"])
    assert not list(export_dir.glob("_reduced*"))  # never published

    real = graphs._reader

    def corrupt(store, key, dtype, cut, shape):
        produce = real(store, key, dtype, cut, shape)
        if key != "model.layers.2.mlp.down_proj.weight":  # a layer the export copied from layer 0
            return produce
        return lambda: (block * 1.5 for block in produce())

    monkeypatch.setattr(graphs, "_reader", corrupt)
    with pytest.raises(ExportValidationError, match="export validation failed"):
        _export_only(tiny_llama_pair, tmp_path / "bad")


def test_int4_from_an_fp16_export_stays_lossless(tiny_llama_pair: TinyPair, tmp_path: Path) -> None:
    engine = open_engine(tiny_llama_pair, tmp_path, export={"dtype": "fp16"}, compile={"ort": {"precision": "int4"}})
    facts = json.loads((engine.compile_dir / "compile.json").read_text())
    assert facts["checks"].startswith("smoke") and facts["checks"].endswith("causal invariance")
    for prompt in _prompts(engine, n=4):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=10)
        assert engine.generate(prompt, mode="dflash", max_new_tokens=10).tokens == plain.tokens


def test_reduced_model_falls_back_to_its_own_trace(tiny_qwen3_pair: TinyPair, tmp_path: Path, monkeypatch):
    """When the reduced model cannot be grown from the traced layers, it is traced itself and still validates."""
    from dflash_cli.exporting import reduced, validate
    from dflash_cli.stages import export
    from dflash_cli.stages.pipeline import artifact_paths

    monkeypatch.setattr(export, "FULL_VALIDATION_BYTES", 0)
    monkeypatch.setattr(reduced, "VOCAB", 300)

    def refuse(self, gname, *args):
        raise RuntimeError("not this time")

    monkeypatch.setattr(reduced.ReducedGraphs, "_grow", refuse)
    real = validate._export_reduced
    traced = []
    monkeypatch.setattr(validate, "_export_reduced", lambda *a: traced.append(a) or real(*a))
    recipe, cache = _export_only(tiny_qwen3_pair, tmp_path)
    assert len(traced) == 1
    doc = json.loads((artifact_paths(recipe, cache, ["export"])["export"] / "validation.json").read_text())
    assert doc["mode"].startswith("reduced model:") and all(c["ok"] for c in doc["checks"])


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_stacked_projections_compute_what_separate_ones_do(family: str, request, tmp_path: Path) -> None:
    """q/k/v (and gate/up) in one MatMulNBits + Split: same numbers as one MatMulNBits per weight."""
    import shutil

    from dflash_cli.backends.ort import OrtSession
    from dflash_cli.ortcompile.checks import reference_outputs
    from dflash_cli.ortcompile.quantize import quantize_graph

    engine = request.getfixturevalue(f"{family}_engine")
    export = engine.export_dir
    info = json.loads((export / "export.json").read_text())
    vocab = json.loads((export / "pair.json").read_text())["vocab_size"]
    outs = {}
    for stacked in (False, True):
        d = tmp_path / str(stacked)
        d.mkdir()
        for f in export.iterdir():
            if f.suffix == ".data":
                shutil.copy(f, d / f.name)
        result = quantize_graph(export / "target.onnx", d / "target.onnx", bits=4, block_size=16, fuse_siblings=stacked)
        assert (result.stacked > 0) == stacked
        outs[stacked] = reference_outputs(OrtSession(d / "target.onnx", "target"), "target", info, vocab)
    for (_, separate), (_, together) in zip(outs[False], outs[True]):
        for name, want in separate.items():
            if want.dtype.kind == "f":
                np.testing.assert_allclose(together[name], want, rtol=1e-5, atol=1e-5, err_msg=name)
            else:
                np.testing.assert_array_equal(together[name], want, err_msg=name)
