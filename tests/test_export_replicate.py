"""The export traces one decoder layer and copies it to the real depth: same graphs' outputs, bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from dflash_cli.exporting.graphs import PairShape, export_pair
from dflash_cli.exporting.replicate import ReplicationError
from dflash_cli.modeling.loading import load_pair_info, target_config
from dflash_cli.pipeline import artifact_paths
from tests.engines import build_recipe
from tests.fixtures.tiny_pairs import TinyPair

GRAPHS = ("target", "target_prefix", "draft", "draft_prefix")


def _inject(pair: TinyPair, root: Path, **overrides) -> Path:
    recipe, cache = build_recipe(pair, root, **overrides)
    return artifact_paths(recipe, cache, ("inject",))["inject"]


def _export(src: Path, out: Path, monkeypatch, *, replicate: bool, dtype=torch.float32) -> list[str]:
    monkeypatch.setenv("DFLASH_EXPORT_REPLICATE", "1" if replicate else "0")
    pair = load_pair_info(src)
    shape = PairShape(pair["block_size"], 2 * pair["block_size"], 96, pair["hidden_size"])
    out.mkdir()
    notes: list[str] = []
    export_pair(src, out, shape, dtype=dtype, logits=True, opset=18, progress=notes.append)
    return notes


def _feeds(session, graph: str, rng) -> dict[str, np.ndarray]:
    s, filled = 4, 9
    feeds = {}
    for i in session.get_inputs():
        dims = [s if d == "seq_len" else filled if isinstance(d, str) else d for d in i.shape]
        if i.name in ("input_ids",):
            feeds[i.name] = rng.integers(0, 300, dims).astype(np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = (np.arange(s) + filled)[None].astype(np.int64)
        elif i.name == "context_position_ids":
            feeds[i.name] = (np.arange(s) + filled - s)[None].astype(np.int64)
        else:
            dtype = np.float16 if "float16" in i.type else np.float32
            feeds[i.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def _same_outputs(a: Path, b: Path) -> None:
    import onnxruntime as ort

    for g in GRAPHS:
        sa = ort.InferenceSession(str(a / f"{g}.onnx"), providers=["CPUExecutionProvider"])
        sb = ort.InferenceSession(str(b / f"{g}.onnx"), providers=["CPUExecutionProvider"])
        assert [i.name for i in sa.get_inputs()] == [i.name for i in sb.get_inputs()], g
        assert [o.name for o in sa.get_outputs()] == [o.name for o in sb.get_outputs()], g
        feeds = _feeds(sa, g, np.random.default_rng(0))
        for name, x, y in zip([o.name for o in sa.get_outputs()], sa.run(None, feeds), sb.run(None, feeds)):
            np.testing.assert_array_equal(x, y, err_msg=f"{g}: {name}")


@pytest.mark.parametrize("fixture", ["tiny_qwen3_pair", "tiny_llama_pair"])
def test_replicated_graphs_equal_full_traces(fixture, request, tmp_path, monkeypatch) -> None:
    pair = request.getfixturevalue(fixture)
    src = _inject(pair, tmp_path / "build")
    notes = _export(src, tmp_path / "replicated", monkeypatch, replicate=True)
    assert not [n for n in notes if "tracing every layer" in n], notes  # no fallback on our own models
    _export(src, tmp_path / "full", monkeypatch, replicate=False)
    _same_outputs(tmp_path / "replicated", tmp_path / "full")
    model = onnx.load(str(tmp_path / "replicated" / "target.onnx"), load_external_data=False)
    weights = {i.name for i in model.graph.initializer if ".layers." in i.name}
    layers = target_config(src).num_hidden_layers
    assert layers > 2
    for k in range(layers):  # every layer reads its own weights, copies included
        assert any(f"model.layers.{k}.mlp.down_proj.weight" in w for w in weights), k
    scopes = {p.value for n in model.graph.node for p in n.metadata_props if p.key.endswith("name_scopes")}
    assert any(f"layers.{layers - 1}.input_layernorm" in s for s in scopes)  # ORT's norm fusion finds copies


def test_replicated_taps_include_the_last_layer(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    src = _inject(tiny_qwen3_pair, tmp_path / "build", dflash={"target_layer_ids": [0, 3]})
    _export(src, tmp_path / "replicated", monkeypatch, replicate=True)
    _export(src, tmp_path / "full", monkeypatch, replicate=False)
    _same_outputs(tmp_path / "replicated", tmp_path / "full")


def test_replicated_fp16_graphs_equal_full_traces(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    src = _inject(tiny_qwen3_pair, tmp_path / "build")
    _export(src, tmp_path / "replicated", monkeypatch, replicate=True, dtype=torch.float16)
    _export(src, tmp_path / "full", monkeypatch, replicate=False, dtype=torch.float16)
    _same_outputs(tmp_path / "replicated", tmp_path / "full")


def test_unexpected_graph_shape_falls_back_to_a_full_trace(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    """A traced graph replication does not understand is traced in full, with a note, never exported wrong."""
    src = _inject(tiny_qwen3_pair, tmp_path / "build")

    def refuse(*args, **kwargs):
        raise ReplicationError("test: refused")

    monkeypatch.setattr("dflash_cli.exporting.replicate.replicate_layers", refuse)
    notes = _export(src, tmp_path / "fallback", monkeypatch, replicate=True)
    assert sum("tracing every layer (test: refused)" in n for n in notes) == 4
    _export(src, tmp_path / "full", monkeypatch, replicate=False)
    _same_outputs(tmp_path / "fallback", tmp_path / "full")
