"""Static fp16 hazards: graph patterns that go wrong when a compiler converts the graph to fp16.

QAIC's -convert-to-fp16 computes every float tensor in fp16. Three patterns break there, and each
is recognisable in the graph itself, so a report can name the cause rather than only the symptom:

  mask-constant     a float constant beyond fp16's range (float32's minimum as the attention mask
                    value) becomes -inf; a fully masked padding row then turns into NaN.
  rope-angles       Cos/Sin of position x inv_freq computed in the graph: the fp16 angle is off by
                    whole radians past position ~2048 (look cos/sin up in tables instead).
  rmsnorm-unscaled  a mean of squares of unscaled activations (RMSNorm's x^2): x^2 overflows fp16
                    for |x| > 256, and residual streams carry outliers of 1e3-1e4.

Heuristics over op patterns, not proofs: the fp16 emulation (fp16_bands) measures the effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

FP16_MAX = 65504.0
MAX_CONSTANT_ELEMENTS = 4096  # larger tensors are weights, which a conversion clips per value anyway

HINTS = {
    "mask-constant": "use a finite mask value such as -65504 (fp16's most negative)",
    "rope-angles": "gather precomputed cos/sin tables by position",
    "rmsnorm-unscaled": "scale x before squaring (a coarse pass on x/256 estimates the RMS)",
}


@dataclass(frozen=True)
class Hazard:
    kind: str  # a key of HINTS
    where: str  # node or tensor name
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "where": self.where, "detail": self.detail, "hint": HINTS[self.kind]}


def fp16_hazards(model: onnx.ModelProto) -> list[Hazard]:
    """Every hazard in the main graph (weights in external data are not loaded or needed)."""
    graph = model.graph
    consts = _small_constants(graph)
    producer = {out: node for node in graph.node for out in node.output}
    found: list[Hazard] = []
    for name, array in consts.items():
        big = np.abs(array[np.isfinite(array)]) if array.dtype.kind == "f" else np.array([])
        if big.size and big.max() > FP16_MAX:
            found.append(Hazard("mask-constant", name, f"value {float(big.max()):.3g} overflows fp16 to inf"))
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == 1 and abs(attr.f) > FP16_MAX:  # AttributeProto.FLOAT
                found.append(Hazard("mask-constant", node.name, f"attribute {attr.name}={attr.f:.3g}"))
        if node.op_type in ("Cos", "Sin"):
            found.append(Hazard("rope-angles", node.name, f"{node.op_type} computed in the graph"))
        if node.op_type == "ReduceMean" and node.input:
            base = _squared_operand(producer.get(node.input[0]), consts)
            if base is not None and not _scaled(producer.get(base), consts):
                found.append(Hazard("rmsnorm-unscaled", node.name, f"mean of {base}^2, {base} not scaled first"))
    return found


def _small_constants(graph) -> dict[str, np.ndarray]:
    """Name -> value of initializers stored in the graph and Constant / ConstantOfShape values."""
    import onnx
    from onnx import numpy_helper

    out: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and _small(init):
            out[init.name] = numpy_helper.to_array(init)
    for node in graph.node:
        if node.op_type in ("Constant", "ConstantOfShape"):
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR and _small(attr.t):
                    out[node.output[0]] = numpy_helper.to_array(attr.t)
                elif attr.name == "value_float":
                    out[node.output[0]] = np.array(attr.f, np.float32)
    return out


def _small(tensor) -> bool:
    return int(np.prod(tensor.dims, dtype=np.int64)) <= MAX_CONSTANT_ELEMENTS


def _squared_operand(node, consts: dict[str, np.ndarray]) -> str | None:
    """X when `node` computes X^2 (Pow(X, 2) or Mul(X, X)), else None."""
    if node is None:
        return None
    if node.op_type == "Pow" and len(node.input) == 2 and node.input[1] in consts:
        exponent = consts[node.input[1]]
        if exponent.size == 1 and float(exponent.reshape(-1)[0]) == 2.0:
            return node.input[0]
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node.input[0]
    return None


def _scaled(node, consts: dict[str, np.ndarray]) -> bool:
    """Whether `node` scales its input down before the square: a Div, or a Mul by a constant below 1."""
    if node is None:
        return False
    if node.op_type == "Div":
        return True
    if node.op_type == "Mul":
        for name in node.input:
            value = consts.get(name)
            if value is not None and value.size == 1 and abs(float(value.reshape(-1)[0])) < 1.0:
                return True
    return False
