"""fp16 emulation: run a graph the way `qaic-compile -convert-to-fp16` computes it, on ONNX Runtime.

QAIC computes in fp16 even when the ONNX is fp32. Overflow (x^2 in an RMSNorm, an unscaled `fc`,
see REFERENCE section 4), a mask constant of float32's minimum, or positions rounded in fp16 show
up only there, so before a card is involved we emulate fp16 on the CPU and compare against fp32.

How: every float tensor is rounded to fp16 where the card would hold it in fp16, while each op
still runs on ONNX Runtime's fp32 kernels. Weights, constants and float graph inputs are rounded
(beyond fp16's range -> +-inf, as a cast does; nothing is clipped), and every float output of every
node passes through a Cast to float16 and back, which ONNX Runtime keeps (a lossy pair is never
folded). Converting the graph's types to float16 instead does not emulate this on the CPU: the CPU
provider lacks fp16 kernels for most ops (Pow, ReduceMean, Sqrt...), runs them in fp32 behind
inserted Casts and drops the Casts between neighbours, so whole chains stay fp32 (measured: a
one-pass RMSNorm with |x| = 1000 came out exact where fp16 gives 0).

Limits (documented, not hidden): accumulation inside an op (MatMul, ReduceMean, Softmax) stays
fp32, as on accelerators with wide accumulators; the device's own kernels may round differently;
agreement here is evidence, not proof, of agreement on a card. mxfp6/mxint8 are not emulated.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

FP16_MAX = 65504.0
_EXTERNAL_DATA_BYTES = 1 << 30  # write weights beside the .onnx above 1 GiB (protobuf caps at 2 GiB)
_ROUND_SUFFIX = "__fp32"  # a node's unrounded output; the original name then holds the rounded value


def to_fp16(onnx_path: Path, out_path: Path) -> Path:
    """Write an fp16-emulating copy of `onnx_path` to `out_path`; returns `out_path`.

    Same inputs and outputs, same types (float32 and int64), so the same feeds and readers work for
    both graphs; every float value inside is an fp16 value. Local functions are inlined first.
    """
    import onnx
    from onnx.inliner import inline_local_functions

    from dflash_cli.exporting.onnx_data import load_with_data

    onnx_path, out_path = Path(onnx_path), Path(out_path)
    model = load_with_data(onnx_path)  # external data loaded: weights are rounded too
    if model.functions:
        model = inline_local_functions(model)
    float_values = _float_values(onnx_path, model)
    _round_constants(model.graph)
    _round_between_ops(model.graph, float_values)
    big = model.ByteSize() > _EXTERNAL_DATA_BYTES
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if big:
        onnx.save_model(
            model,
            str(out_path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=out_path.name + ".data",
        )
    else:
        onnx.save_model(model, str(out_path))
    return out_path


def _float_values(onnx_path: Path, model) -> set[str]:
    """Names of float32 tensors (graph inputs and node outputs), by shape inference without weights."""
    import onnx

    light = onnx.ModelProto()
    light.CopyFrom(model)
    for init in light.graph.initializer:  # weights: their types and dims are all inference needs
        if init.data_type == onnx.TensorProto.FLOAT:
            init.ClearField("raw_data")
            init.ClearField("float_data")
    inferred = onnx.shape_inference.infer_shapes(light)
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    return {v.name for v in values if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}


def _round(array: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond fp16's range becomes +-inf, as on the card
        return array.astype(np.float16).astype(np.float32)


def _round_constants(graph) -> None:
    """Initializers, Constant and ConstantOfShape values rounded to fp16 values (types kept)."""
    import onnx
    from onnx import numpy_helper

    def fix(tensor) -> None:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(_round(numpy_helper.to_array(tensor)), tensor.name))

    for init in graph.initializer:
        fix(init)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                fix(attr.t)
            elif attr.type == onnx.AttributeProto.FLOAT:
                attr.f = float(_round(np.array([attr.f], np.float32))[0])


def _round_between_ops(graph, float_values: set[str]) -> None:
    """Cast every float graph input and node output to float16 and back before anyone reads it."""
    import onnx
    from onnx import helper

    def pair(src: str, dst: str) -> list:
        half = dst + "__fp16"
        return [
            helper.make_node("Cast", [src], [half], to=onnx.TensorProto.FLOAT16, name=half),
            helper.make_node("Cast", [half], [dst], to=onnx.TensorProto.FLOAT, name=dst + "__round"),
        ]

    nodes = []
    renamed_inputs = {}
    for value in graph.input:
        if value.name in float_values:
            renamed_inputs[value.name] = value.name + "__rounded"
            nodes += pair(value.name, renamed_inputs[value.name])
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed_inputs:
                node.input[i] = renamed_inputs[name]
        rounding = []
        for i, name in enumerate(node.output):
            if name in float_values:
                node.output[i] = name + _ROUND_SUFFIX
                rounding += pair(node.output[i], name)
        nodes += [node, *rounding]
    for out in graph.output:  # a graph input passed straight through to an output keeps its name
        if out.name in renamed_inputs:
            raise ValueError(f"graph output {out.name} is a float input passed through; not supported")
    del graph.node[:]
    graph.node.extend(nodes)


def detect_nonfinite(outputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Output name -> count of NaN/inf values, for floating outputs that have any."""
    found: dict[str, int] = {}
    for name, array in outputs.items():
        array = np.asarray(array)
        if np.issubdtype(array.dtype, np.floating):
            count = int(array.size - np.count_nonzero(np.isfinite(array)))
            if count:
                found[name] = count
    return found


class NonfiniteWatch:
    """Session wrapper counting NaN/inf in every output of every call into `counts` (keys: `prefix` + output).

    With `reset_fill`, reset() fills the cache with that value instead of zeros: what a card's retained
    buffers may hold at the start of a sequence (fp16_bands uses NaN)."""

    def __init__(self, inner, counts: dict[str, int], prefix: str = "", reset_fill: float | None = None) -> None:
        self.inner, self.counts, self.prefix, self.reset_fill = inner, counts, prefix, reset_fill

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self) -> None:
        if self.reset_fill is None:
            self.inner.reset()
        else:
            self.inner.reset(fill=self.reset_fill)

    def run(self, feeds):
        out = self.inner.run(feeds)
        for k, n in detect_nonfinite(out).items():
            self.counts[self.prefix + k] = self.counts.get(self.prefix + k, 0) + n
        return out
