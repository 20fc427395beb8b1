"""Static-shape check: with `seq_len` fixed per specialization, is every tensor's shape known?

The QAIC compiler needs every intermediate shape static once the specialization's symbols are
bound. ONNX shape inference (strict, with data propagation through Shape/Reshape chains) is
a cheap stand-in: a tensor it cannot resolve is one the compiler may reject, or compile into
a slow dynamic path. It is an approximation in both directions, and says so in its report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from dflash_cli.readiness.report import ShapeCheck

if TYPE_CHECKING:
    import onnx

SEQ_SYMBOL = "seq_len"


def fix_symbols(model: onnx.ModelProto, values: Mapping[str, int]) -> onnx.ModelProto:
    """Copy of `model` with the named dim_params of its inputs/outputs set to values.

    Existing value_info is dropped: exporters leave symbolic intermediate shapes there, and
    inference should derive them afresh from the fixed inputs.
    """
    import onnx

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in [*fixed.graph.input, *fixed.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in values:
                dim.dim_value = int(values[dim.dim_param])  # setting the oneof clears dim_param
    del fixed.graph.value_info[:]
    return fixed


def _shape_text(value: onnx.ValueInfoProto) -> str | None:
    """None when fully static, else a readable shape such as "[1, seq_len, ?]"."""
    if not value.type.HasField("tensor_type"):
        return None  # sequences/maps: not produced by our graphs; nothing to say
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return "unknown rank"
    dims = []
    static = True
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(str(dim.dim_value))
        else:
            static = False
            dims.append(dim.dim_param or "?")
    return None if static else f"[{', '.join(dims)}]"


def check_static_shapes(model: onnx.ModelProto, name: str, seq_len: int, batch_size: int = 0) -> ShapeCheck:
    """One specialization: fix `seq_len` (and `batch_size`, of a graph with batch_index), infer, list every
    tensor whose shape is not static."""
    import onnx

    fixed = fix_symbols(model, {SEQ_SYMBOL: seq_len, **({"batch_size": batch_size} if batch_size else {})})
    try:
        inferred = onnx.shape_inference.infer_shapes(fixed, strict_mode=True, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        return ShapeCheck(name, seq_len, non_static=[], error=f"shape inference failed: {exc}")
    graph = inferred.graph
    known = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}
    non_static: list[str] = []
    for value in graph.input:
        text = _shape_text(value)
        if text:
            non_static.append(f"input {value.name}: {text}")
    for node in graph.node:
        for out in node.output:
            if not out:
                continue  # optional output left unused
            value = known.get(out)
            text = "no shape inferred" if value is None else _shape_text(value)
            if text:
                non_static.append(f"{out} ({node.op_type}): {text}")
    return ShapeCheck(name, seq_len, non_static=non_static)
