"""The exported graphs survive a compiler's fp16 conversion: no float constant overflows fp16.

QAIC compiles with -convert-to-fp16; a constant beyond fp16's range (float32's minimum used as the
attention mask value, -3.4e38) becomes -inf there, and a fully masked padding row of a prefill chunk
turns into NaN. Every float constant, attribute tensor and small initializer is checked.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from dflash_cli.modeling.layers import MASKED_SCORE, grouped_attention

FP16_MAX = float(np.finfo(np.float16).max)


def _float_constants(model: onnx.ModelProto, max_elements: int = 4096):
    """(where, array) for every float tensor stored in the graph itself (weights live in external data)."""

    def tensors(graph: onnx.GraphProto):
        for init in graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                yield f"initializer {init.name}", init
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield f"{node.op_type} {node.name}.{attr.name}", attr.t
                elif attr.type == onnx.AttributeProto.FLOAT:
                    yield f"{node.op_type} {node.name}.{attr.name}", attr.f
                for sub in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                    yield from tensors(sub)

    for where, t in tensors(model.graph):
        if isinstance(t, float):
            yield where, np.array([t], np.float32)
            continue
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16):
            array = numpy_helper.to_array(t)
            if array.size <= max_elements:
                yield where, array


@pytest.mark.parametrize("graph", ["target", "draft"])
def test_exported_float_constants_are_finite_in_fp16(qwen3_engine, graph):
    model = onnx.load(str(qwen3_engine.export_dir / f"{graph}.onnx"), load_external_data=False)
    overflowing = [
        (where, float(np.abs(a).max()))
        for where, a in _float_constants(model)
        if a.size and np.isfinite(a).all() and np.abs(a).max() > FP16_MAX
    ]
    assert overflowing == [], f"constants beyond fp16's range in {graph}.onnx: {overflowing[:5]}"


def test_fully_masked_row_stays_finite_with_fp16_numbers():
    """A padding row that sees nothing: its softmax over MASKED_SCORE everywhere is uniform, not NaN,
    with every tensor (and the mask value) in fp16."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 8).half() for _ in range(3))
    visible = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    visible[..., 2, :] = False  # the last query position is padding: fully masked
    out = grouped_attention(q.float(), k.float(), v.float(), visible).half()
    assert torch.isfinite(out).all()
    scores = torch.full((3,), MASKED_SCORE, dtype=torch.float16)
    assert torch.isfinite(scores).all() and torch.isfinite(torch.softmax(scores.float(), -1)).all()
