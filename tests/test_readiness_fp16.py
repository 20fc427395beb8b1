"""fp16 emulation: the converted tiny graphs agree with fp32 on ONNX Runtime and stay finite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dflash_cli.readiness.fp16 import detect_nonfinite, to_fp16
from tests.qaic_graphs import TinyDims, build_target, with_local_function, write_export_dir

D = TinyDims()


def _run(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _cache(layers: int) -> dict[str, np.ndarray]:
    shape = (1, D.kv_heads, D.ctx_len, D.head_dim)
    return {f"past_{k}.{i}": np.zeros(shape, np.float32) for i in range(layers) for k in ("key", "value")}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("fp16")
    export = write_export_dir(tmp / "export", D)
    return {
        "target": export / "target.onnx",
        "draft": export / "draft.onnx",
        "target16": to_fp16(export / "target.onnx", tmp / "target16.onnx"),
        "draft16": to_fp16(export / "draft.onnx", tmp / "draft16.onnx"),
    }


def _prefill_feeds() -> dict[str, np.ndarray]:
    # A 5-token prompt right-padded to the prefill length with position -1.
    ids = np.array([[3, 14, 15, 9, 26, 0, 0, 0]], np.int64)
    pos = np.array([[0, 1, 2, 3, 4, -1, -1, -1]], np.int64)
    return {"input_ids": ids, "position_ids": pos, **_cache(D.target_layers)}


def test_emulating_graph_holds_fp16_values_with_fp32_io(graphs: dict[str, Path]) -> None:
    from onnx import numpy_helper

    model = onnx.load(str(graphs["target16"]))
    weights = [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert weights and all(np.array_equal(w, w.astype(np.float16).astype(np.float32)) for w in weights)
    # Every float node output goes through Cast(to=float16) before anyone reads it.
    to_half = {
        n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.attribute[0].i == onnx.TensorProto.FLOAT16
    }
    raw = [o for n in model.graph.node if n.op_type != "Cast" for o in n.output if o.endswith("__fp32")]
    assert len(raw) > 10 and set(raw) <= to_half
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert matmuls and all(o.endswith("__fp32") for n in matmuls for o in n.output)
    io_types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert io_types["input_ids"] == onnx.TensorProto.INT64 and io_types["tokens"] == onnx.TensorProto.INT64
    assert io_types["past_key.0"] == onnx.TensorProto.FLOAT  # callers feed float32, as for the fp32 graph
    assert io_types["logits"] == onnx.TensorProto.FLOAT


def test_target_fp16_agrees_with_fp32(graphs: dict[str, Path]) -> None:
    feeds = _prefill_feeds()
    ref, half = _run(graphs["target"], feeds), _run(graphs["target16"], feeds)
    assert detect_nonfinite(half) == {}
    # Padded rows (position -1) see nothing: the mask value must stay finite in fp16 (the emulation does
    # not clip constants, so float32's minimum there would become -inf and these rows NaN).
    np.testing.assert_array_equal(ref["tokens"][:, :5], half["tokens"][:, :5])
    for name in ("logits", "context_features", "past_key.1_RetainedState"):
        np.testing.assert_allclose(half[name], ref[name], rtol=2e-2, atol=2e-2, err_msg=name)


def test_draft_fp16_agrees_with_fp32(graphs: dict[str, Path]) -> None:
    target = _run(graphs["target"], _prefill_feeds())
    feeds = {
        "input_ids": np.array([[int(target["tokens"][0, 4]), 31, 31, 31]], np.int64),
        "position_ids": np.arange(5, 5 + D.block_size, dtype=np.int64).reshape(1, -1),
        "context_features": target["context_features"],
        "context_position_ids": np.array([[0, 1, 2, 3, 4, -1, -1, -1]], np.int64),
        **_cache(D.draft_layers),
    }
    ref, half = _run(graphs["draft"], feeds), _run(graphs["draft16"], feeds)
    assert detect_nonfinite(half) == {}
    np.testing.assert_array_equal(ref["draft_tokens"], half["draft_tokens"])
    np.testing.assert_allclose(half["draft_logits"], ref["draft_logits"], rtol=2e-2, atol=2e-2)


def test_local_functions_are_inlined(tmp_path: Path) -> None:
    src = tmp_path / "fn.onnx"
    onnx.save(with_local_function(build_target(D)), str(src))
    out = onnx.load(str(to_fp16(src, tmp_path / "fn16.onnx")))
    assert not out.functions
    half = _run(tmp_path / "fn16.onnx", _prefill_feeds())
    assert half["tokens"].shape == (1, 8)


def test_detect_nonfinite() -> None:
    outputs = {
        "logits": np.array([1.0, np.inf, np.nan], np.float32),
        "tokens": np.array([1, 2], np.int64),
        "ok": np.zeros(3, np.float16),
    }
    assert detect_nonfinite(outputs) == {"logits": 2}


def test_emulation_does_not_clip_what_the_compiler_would_not(tmp_path: Path) -> None:
    """float32's minimum as the mask value turns into -inf in fp16 and the padded rows of a prefill
    chunk into NaN: the emulation shows it (it used to clip the constant to -65504 and hide it)."""
    import numpy as np

    old = build_target(D, mask_value=float(np.finfo(np.float32).min))
    onnx.save(old, str(tmp_path / "old.onnx"))
    half = _run(to_fp16(tmp_path / "old.onnx", tmp_path / "old16.onnx"), _prefill_feeds())
    assert detect_nonfinite(half), "float32's minimum should not survive fp16"
