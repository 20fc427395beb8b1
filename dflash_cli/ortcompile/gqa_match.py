"""Finding each layer's attention projections in an exported prefix-cache target (for ortcompile/gqa.py).

Layers are anchored by their weights' names, not by op patterns: layer i's projections are the MatMuls of
initializers named `...layers.i.self_attn.{q,k,v,o}_proj.weight` (plain, transposed, MatMulNBits' `.w4` /
`.w8`, w8a8's RowsMatMul `.w8a8` [in, out], or one stacked q/k/v projection and its Split that names its
parts, ortcompile/quantize.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_PROJ = re.compile(r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight(\.w\d+(a8)?)?$")


@dataclass
class GraphIndex:
    """Name lookups over the graph as exported (taken before the rewrite changes anything)."""

    inputs: dict[str, Any]
    outputs: dict[str, Any]
    inits: dict[str, Any]
    producers: dict[str, Any]
    consumers: dict[str, list]

    @classmethod
    def of(cls, graph) -> GraphIndex:
        consumers: dict[str, list] = {}
        for n in graph.node:
            for name in n.input:
                consumers.setdefault(name, []).append(n)
        return cls(
            inputs={i.name: i for i in graph.input},
            outputs={o.name: o for o in graph.output},
            inits={t.name: t for t in graph.initializer},
            producers={o: n for n in graph.node for o in n.output},
            consumers=consumers,
        )

    def weight_of(self, node) -> str | None:
        if node.op_type not in ("MatMul", "MatMulNBits", "RowsMatMul") or len(node.input) < 2:
            return None
        b = node.input[1]
        if b not in self.inits and b in self.producers and self.producers[b].op_type == "Transpose":
            b = self.producers[b].input[0]
        return b if b in self.inits else None

    def single(self, name: str, op: str):
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op and name not in self.outputs else None


@dataclass
class Projections:
    """Each layer's projections, found by their weights' names (the module docstring)."""

    outputs: dict[int, dict[str, str]] = field(default_factory=dict)  # layer -> q/k/v/o -> its output tensor
    o_proj: dict[int, Any] = field(default_factory=dict)  # layer -> the o_proj node (reads the attention)
    q_width: dict[int, int | None] = field(default_factory=dict)


def find_projections(graph, index: GraphIndex) -> Projections:
    found = Projections()
    for node in graph.node:
        for w, out, width in _projections(node, index.weight_of, index.consumers, index.inits):
            m = _PROJ.search(w)
            if m:
                layer, kind = int(m.group(1)), m.group(2)
                found.outputs.setdefault(layer, {})[kind] = out
                if kind == "o":
                    found.o_proj[layer] = node
                if kind == "q":
                    found.q_width[layer] = width
    return found


def with_bias(name: str, single, inits) -> str:
    add = single(name, "Add")
    if add is not None and any(i in inits for i in add.input):
        return add.output[0]
    return name


def normed_heads(proj_out: str, single) -> tuple[str, bool] | None:
    """(tensor to feed GroupQueryAttention, whether it is [b, s, heads, d] and needs flattening)."""
    reshape = single(proj_out, "Reshape")
    if reshape is None:
        return None
    norm = single(reshape.output[0], "SimplifiedLayerNormalization")
    if norm is not None:
        return norm.output[0], True
    # No per-head norm (Llama): the projection's output is already [b, s, heads * d].
    return proj_out, False


def _projections(node, weight_of, consumers, inits):
    """(weight name, output tensor, output width) of each projection `node` computes: one for a MatMul,
    one per part for a stacked MatMulNBits (ortcompile/quantize.py: q/k/v in one node, then a Split)."""
    from onnx import numpy_helper

    from dflash_cli.ortcompile.quantize import STACKED_WEIGHTS_KEY

    parts = next((p.value.split(",") for p in node.metadata_props if p.key == STACKED_WEIGHTS_KEY), None)
    if parts is None:
        w = weight_of(node)
        return [(w, node.output[0], _out_features(node, inits[w]))] if w else []
    users = consumers.get(node.output[0], [])
    if len(users) != 1 or users[0].op_type != "Split" or len(users[0].output) != len(parts):
        return []
    split = users[0]
    sizes = inits.get(split.input[1]) if len(split.input) > 1 else None
    widths = [int(x) for x in numpy_helper.to_array(sizes)] if sizes is not None else [None] * len(parts)
    return list(zip(parts, split.output, widths))


def _out_features(node, weight) -> int | None:
    """A projection's output width: MatMulNBits says N; a MatMul (or RowsMatMul) reads W [in, out] or
    Transpose(W [out, in])."""
    if node.op_type == "MatMulNBits":
        return next((a.i for a in node.attribute if a.name == "N"), None)
    if len(weight.dims) != 2:
        return None
    return weight.dims[1] if node.input[1] == weight.name else weight.dims[0]
