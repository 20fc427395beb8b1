"""compile.ort.precision w8a8: int8 weights times each activation row quantised on its own (RowsMatMul)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_cli.ortcompile.rows_product import WEIGHT_LEVELS, add_function, quantize_columns, rows_node
from tests.engines import mixed_prompts, open_engine
from tests.fixtures.tiny_pairs import TinyPair


def _session(codes: np.ndarray, scales: np.ndarray, opset: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    K = codes.shape[0]
    graph = helper.make_graph(
        [rows_node("x", ["y"], "proj", "w", "s")],
        "rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "rows", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(codes, "w"), numpy_helper.from_array(scales, "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    add_function(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("opset", [17, 21])
def test_rows_are_exact_integer_sums_at_any_call_length(opset: int) -> None:
    rng = np.random.default_rng(0)
    K, N = 384, 160
    w = rng.standard_normal((N, K)).astype(np.float32) * 0.05
    w[3, 7] = 2.0  # an outlier sets its column's scale, not the others'
    codes, scales = quantize_columns(w, transposed=True)
    assert codes.shape == (K, N) and codes.dtype == np.int8 and np.abs(codes).max() == WEIGHT_LEVELS
    kn_codes, kn_scales = quantize_columns(np.ascontiguousarray(w.T), transposed=False)
    assert np.array_equal(kn_codes, codes) and np.array_equal(kn_scales, scales)
    sess = _session(codes, scales, opset)
    x = rng.standard_normal((1, 12, K)).astype(np.float32) * 3
    x[0, 4] = 0.0  # a padding row: zeros out, no NaN
    x[0, 5, 9] = 400.0  # a row with an outlier input
    y = sess.run(None, {"x": x})[0]
    # What the graph must compute, in int64 (no saturation anywhere: 7-bit weights keep AVX2's
    # 16-bit pair sums in range), then the row's and the column's scale.
    row_scale = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-30)) / np.float32(127)
    q = np.clip(np.rint(x / row_scale), -127, 127).astype(np.int64)
    want = (q @ codes.astype(np.int64)).astype(np.float32) * row_scale * scales
    assert np.array_equal(y, want)
    assert np.abs(y[0, 4]).max() == 0.0
    for rows in (1, 2, 5):  # every row the same whatever else is in the call
        assert np.array_equal(sess.run(None, {"x": x[:, :rows]})[0], y[:, :rows])
        assert np.array_equal(sess.run(None, {"x": x[:, rows : rows + 1]})[0], y[:, rows : rows + 1])
    ref = x[0, :4] @ w.T
    others = np.arange(N) != 3  # the outlier's column is coarse: its scale is 2 / 63
    assert np.abs(y[0, :4] - ref)[:, others].max() < 0.03 * np.abs(ref).max()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_w8a8_build_is_checked_and_lossless(family: str, request, tmp_path: Path) -> None:
    import onnx

    pair: TinyPair = request.getfixturevalue(f"tiny_{family}_pair")
    engine = open_engine(pair, tmp_path, compile={"ort": {"precision": "w8a8"}})
    facts = json.loads((engine.compile_dir / "compile.json").read_text())
    assert facts["precision"] == "w8a8" and facts["target_stacked_matmuls"] > 0
    assert set(facts["causal_invariance_max_diff"].values()) == {0.0}
    assert set(facts["prefix_call_length_max_diff"].values()) == {0.0}
    # The prefix-cache target's attention is still found through the stacked q/k/v projection.
    assert facts["target_prefix_fused"]["attention"] > 0
    graph = onnx.load(str(engine.compile_dir / "target.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert "RowsMatMul" in ops and "MatMulNBits" not in ops
    weights = {t.name for t in graph.initializer}
    assert not [n.name for n in graph.node if n.op_type == "MatMul" and set(n.input) & weights]
    # Every projection is counted for the bench's rate of a verify row, as in the exported graph.
    from dflash_cli.ortcompile.checks import projection_macs

    (export,) = (engine.compile_dir.parent.parent / "export").iterdir()
    assert projection_macs(engine.compile_dir / "target.onnx") == projection_macs(export / "target.onnx") > 0
    for prompt in mixed_prompts(engine.tokenizer.vocab_size, n=12):
        plain = engine.generate(prompt, mode="plain", max_new_tokens=10)
        for mode in ("dflash", "lookup", "hybrid"):
            assert engine.generate(prompt, mode=mode, max_new_tokens=10).tokens == plain.tokens, (mode, prompt)


def test_w8a8_refused_on_fp16_activations() -> None:
    from dflash_cli.errors import RecipeError
    from dflash_cli.recipe.schema import load_recipe

    with pytest.raises(RecipeError, match="w8a8 computes on fp32 activations"):
        load_recipe("demo", ["compile.ort.precision=w8a8", "export.dtype=fp16"])
