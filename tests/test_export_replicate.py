"""The export traces one decoder layer and copies it to the real depth: same graphs' outputs, bit for bit."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from dflash_cli.exporting.names import BLOCK_ROWS, PROPOSAL_ROWS
from dflash_cli.exporting.options import ExportOptions
from dflash_cli.modeling.loading import target_config
from tests.exports import OPTIONS, REFUSAL, export, inject

pytestmark = pytest.mark.slow  # builds or exports pairs: left out of `make test-fast`

GRAPHS = ("target", "target_prefix", "draft", "draft_prefix")
STATIC = ("target", "draft")


def _feeds(session, rng) -> dict[str, np.ndarray]:
    s, filled = 4, 9
    feeds = {}
    for i in session.get_inputs():
        # a call's rows (a draft prefix graph's block_len too) are s; every other symbolic dim is the filled cache
        dims = [s if d in ("seq_len", BLOCK_ROWS) else filled if isinstance(d, str) else d for d in i.shape]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 300, dims).astype(np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = (np.arange(s) + filled)[None].astype(np.int64)
        elif i.name == "context_position_ids":
            feeds[i.name] = (np.arange(s) + filled - s)[None].astype(np.int64)
        elif i.name == PROPOSAL_ROWS:  # a draft prefix graph's: only its shape is read, fewer than the block's
            feeds[i.name] = np.zeros((1, s - 2), np.int64)
        else:
            dtype = np.float16 if "float16" in i.type else np.float32
            feeds[i.name] = rng.standard_normal(dims).astype(dtype)
    return feeds


def _same_outputs(a: Path, b: Path, graphs=GRAPHS) -> None:
    import onnxruntime as ort

    for g in graphs:
        sa = ort.InferenceSession(str(a / f"{g}.onnx"), providers=["CPUExecutionProvider"])
        sb = ort.InferenceSession(str(b / f"{g}.onnx"), providers=["CPUExecutionProvider"])
        assert [i.name for i in sa.get_inputs()] == [i.name for i in sb.get_inputs()], g
        assert [o.name for o in sa.get_outputs()] == [o.name for o in sb.get_outputs()], g
        feeds = _feeds(sa, np.random.default_rng(0))
        for name, x, y in zip([o.name for o in sa.get_outputs()], sa.run(None, feeds), sb.run(None, feeds)):
            np.testing.assert_array_equal(x, y, err_msg=f"{g}: {name}")


@pytest.mark.parametrize(("family", "full", "graphs"), [("qwen3", "full", GRAPHS), ("llama", "full-static", STATIC)])
def test_replicated_graphs_equal_full_traces(shared_exports, family, full, graphs) -> None:
    replicated = shared_exports.get(family, "replicated")
    _same_outputs(replicated, shared_exports.get(family, full), graphs)
    model = onnx.load(str(replicated / "target.onnx"), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    layers = target_config(shared_exports.injected(family)).num_hidden_layers
    assert layers > 2
    for k in range(layers):  # every layer reads its own weights, copies included
        assert any(f"model.layers.{k}.mlp.down_proj.weight" in w for w in weights), k
    scopes = {p.value for n in model.graph.node for p in n.metadata_props if p.key.endswith("name_scopes")}
    assert any(f"layers.{layers - 1}.input_layernorm" in s for s in scopes)  # ORT's norm fusion finds copies


def test_our_models_replicate_without_a_fallback(shared_exports) -> None:
    shared_exports.get("qwen3", "replicated")
    notes = shared_exports.notes["qwen3", "replicated"]
    assert not [n for n in notes if "tracing every layer" in n], notes


def test_unexpected_graph_shape_falls_back_to_a_full_trace(shared_exports) -> None:
    """A traced graph replication does not understand is traced in full, with a note, never exported
    wrong: the shared `full` exports are made that way, and the test above compares their outputs."""
    shared_exports.get("qwen3", "full")
    notes = shared_exports.notes["qwen3", "full"]
    assert sum(f"tracing every layer ({REFUSAL})" in n for n in notes) == 4, notes


def test_a_last_layer_tap_and_fp16_replicate_as_full_traces(tiny_qwen3_pair, tmp_path) -> None:
    """Taps that include the last layer (read after the final norm) and fp16 graphs, in one export:
    the static graphs only (their prefix-cache forms replicate through the same code, tested above)."""
    src = inject(tiny_qwen3_pair, tmp_path / "build", dflash={"target_layer_ids": [0, 3]})
    options = ExportOptions(dtype="fp16", logits=True, prefix_graphs=False, validation="off")
    export(src, tmp_path / "replicated", options)
    export(src, tmp_path / "full", options, full=True)
    _same_outputs(tmp_path / "replicated", tmp_path / "full", STATIC)


def test_alternating_window_layers_replicate_from_a_sliding_layer(tmp_path) -> None:
    """gpt-oss alternates sliding-window and full-attention layers: the one traced (sliding) layer is
    copied to both kinds, full ones reading the unwindowed mask; the same outputs as tracing every layer
    (the prompt here is longer than the window, so the two masks differ)."""
    from tests.fixtures.tiny_pairs import make_pair

    src = inject(make_pair(tmp_path / "pair", "gpt_oss"), tmp_path / "build")
    assert len(set(target_config(src).layer_types)) == 2
    notes = export(src, tmp_path / "replicated", replace(OPTIONS, prefix_graphs=True))
    assert not [n for n in notes if "tracing every layer" in n], notes
    export(src, tmp_path / "full", OPTIONS, full=True)
    _same_outputs(tmp_path / "replicated", tmp_path / "full", ("target", "target_prefix"))
