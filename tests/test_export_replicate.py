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
from tests.fixtures.tiny_pairs import TinyPair

GRAPHS = ("target", "target_prefix", "draft", "draft_prefix")


def _inject(pair: TinyPair, root: Path, **overrides) -> Path:
    from dflash_cli.cache import Cache
    from dflash_cli.pipeline import build
    from dflash_cli.recipe import load_recipe

    recipe = load_recipe(str(pair.write_recipe(root / "recipe.yaml", **overrides)))
    cache = Cache(root / "cache")
    build(recipe, cache, upto="inject")
    return artifact_paths(recipe, cache, ("inject",))["inject"]


def _export(src: Path, out: Path, *, replicate: bool, dtype=torch.float32) -> list[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_EXPORT_REPLICATE", "1" if replicate else "0")
        pair = load_pair_info(src)
        shape = PairShape(pair["block_size"], 2 * pair["block_size"], 96, pair["hidden_size"])
        out.mkdir()
        notes: list[str] = []
        export_pair(src, out, shape, dtype=dtype, logits=True, opset=18, progress=notes.append)
    return notes


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen3 pair's inject artifact and its graphs traced in full (the reference)."""
    root = tmp_path_factory.mktemp("replicate_qwen3")
    src = _inject(tiny_qwen3_pair, root / "build")
    _export(src, root / "full", replicate=False)
    return {"src": src, "full": root / "full"}


def _feeds(session, rng) -> dict[str, np.ndarray]:
    s, filled = 4, 9
    feeds = {}
    for i in session.get_inputs():
        dims = [s if d == "seq_len" else filled if isinstance(d, str) else d for d in i.shape]
        if i.name == "input_ids":
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
        feeds = _feeds(sa, np.random.default_rng(0))
        for name, x, y in zip([o.name for o in sa.get_outputs()], sa.run(None, feeds), sb.run(None, feeds)):
            np.testing.assert_array_equal(x, y, err_msg=f"{g}: {name}")


def test_replicated_graphs_equal_full_traces(qwen3, tmp_path) -> None:
    notes = _export(qwen3["src"], tmp_path / "replicated", replicate=True)
    assert not [n for n in notes if "tracing every layer" in n], notes  # no fallback on our own models
    _same_outputs(tmp_path / "replicated", qwen3["full"])
    model = onnx.load(str(tmp_path / "replicated" / "target.onnx"), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    layers = target_config(qwen3["src"]).num_hidden_layers
    assert layers > 2
    for k in range(layers):  # every layer reads its own weights, copies included
        assert any(f"model.layers.{k}.mlp.down_proj.weight" in w for w in weights), k
    scopes = {p.value for n in model.graph.node for p in n.metadata_props if p.key.endswith("name_scopes")}
    assert any(f"layers.{layers - 1}.input_layernorm" in s for s in scopes)  # ORT's norm fusion finds copies


def test_unexpected_graph_shape_falls_back_to_a_full_trace(qwen3, tmp_path, monkeypatch) -> None:
    """A traced graph replication does not understand is traced in full, with a note, never exported wrong."""

    def refuse(*args, **kwargs):
        raise ReplicationError("test: refused")

    monkeypatch.setattr("dflash_cli.exporting.replicate.replicate_layers", refuse)
    notes = _export(qwen3["src"], tmp_path / "fallback", replicate=True)
    assert sum("tracing every layer (test: refused)" in n for n in notes) == 4
    _same_outputs(tmp_path / "fallback", qwen3["full"])


@pytest.mark.parametrize(
    ("fixture", "overrides", "dtype"),
    [
        ("tiny_llama_pair", {}, torch.float32),
        ("tiny_qwen3_pair", {"dflash": {"target_layer_ids": [0, 3]}}, torch.float32),  # a tap after the final norm
        ("tiny_qwen3_pair", {}, torch.float16),
    ],
    ids=["llama", "last-layer-tap", "fp16"],
)
def test_replicated_variants_equal_full_traces(fixture, overrides, dtype, request, tmp_path) -> None:
    src = _inject(request.getfixturevalue(fixture), tmp_path / "build", **overrides)
    _export(src, tmp_path / "replicated", replicate=True, dtype=dtype)
    _export(src, tmp_path / "full", replicate=False, dtype=dtype)
    _same_outputs(tmp_path / "replicated", tmp_path / "full")
