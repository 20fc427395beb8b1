"""ONNX Runtime rewrites of the exported graphs: what the accelerator-safe forms cost on a CPU, undone.

The export is built for compilers that run it in fp16 (QAIC): RMSNorm in two passes so x^2 never
overflows, and V zeroed in cache slots no query sees because a card's retained buffers start as
whatever the device memory held. ONNX Runtime computes in the graph's own dtype and its cache
buffers start at zero (OrtSession.reset), so neither guard buys anything there, and both cost (the
demo's plain decode ran ~25% slower with them). The compile stage rewrites its copy of the graph:

  rmsnorm   every RMSNorm module's nodes (found by the exporter's module scopes, not by op
            patterns) -> one SimplifiedLayerNormalization, ONNX Runtime's fused kernel
  v-guard   Where(live, V, 0) feeding the attention's probs @ V -> V
  silu      x * Sigmoid(x) (the MLP's SiLU) -> QuickGelu(x, alpha=1), one kernel instead of two
  attention (the prefix-cache target only) each layer's attention -> one GroupQueryAttention with the
            KV cache updated in place (ortcompile/gqa.py)

The result is checked against the unfused graph on the same calls (checks.matches_reference) before
the build publishes it. Weights are untouched: the rewritten graph points into the same data file.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dflash_cli.exporting.names import CLASSES_KEY, SCOPES_KEY

if TYPE_CHECKING:
    import onnx

NORM_CLASS = "dflash_cli.modeling.layers.RMSNorm"
# Constants of the two-pass form (modeling.layers.rms_normalize) that are not the epsilon.
_FORM_CONSTANTS = (1 / 256, 2.0, -1.0, 256.0, 2.0**-24)


@dataclass
class FuseResult:
    norms: int = 0
    v_guards: int = 0
    silu: int = 0
    attention: int = 0  # layers whose attention became GroupQueryAttention
    merged_pads: int = 0  # of those, layers whose q/k/v are padded once (ortcompile/gqa.py)
    skipped: list[str] = field(default_factory=list)  # what was left as it was, with the reason


def fuse_graph(src: Path, dst: Path, attention: bool = False, windows: list | None = None) -> FuseResult:
    """Rewrite `src` (weights stay in its external data, referenced by the same relative path) into `dst`.

    `attention`: also rewrite the attention (a prefix-cache target graph; see ortcompile/gqa.py)."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    result = FuseResult()
    _fuse_norms(model.graph, result)
    _drop_v_guards(model.graph, result)
    _fuse_silu(model, result)
    if attention:
        from dflash_cli.ortcompile.gqa import rewrite_attention

        gqa = rewrite_attention(model, src.parent, windows)
        result.attention = gqa.layers
        result.merged_pads = gqa.merged_pads
        result.skipped += [f"attention: {why}" for why in gqa.skipped]
    onnx.save(model, str(dst))
    return result


def _metadata(node, key: str) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == key:
            try:
                return list(ast.literal_eval(prop.value))
            except (ValueError, SyntaxError):
                return []
    return []


def _norm_scope(node) -> str | None:
    """The module path of the RMSNorm this node was traced in, or None."""
    classes, scopes = _metadata(node, CLASSES_KEY), _metadata(node, SCOPES_KEY)
    for i, cls in enumerate(classes):
        if cls == NORM_CLASS and i < len(scopes):
            return scopes[i]
    return None


def _scalars(graph) -> dict[str, float]:
    """Name -> value of every single-element float constant stored in the graph."""
    from onnx import numpy_helper

    out: dict[str, float] = {}
    for init in graph.initializer:
        if init.data_location != 1 and int(np.prod(init.dims, dtype=np.int64)) == 1:
            value = numpy_helper.to_array(init)
            if value.dtype.kind == "f":
                out[init.name] = float(value.reshape(-1)[0])
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == 4:  # TENSOR
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.size == 1 and value.dtype.kind == "f":
                out[node.output[0]] = float(value.reshape(-1)[0])
    return out


def _fuse_norms(graph, result: FuseResult) -> None:
    from onnx import helper

    by_scope: dict[str, list] = {}
    for node in graph.node:
        scope = _norm_scope(node)
        if scope is not None:
            by_scope.setdefault(scope, []).append(node)
    if not by_scope:
        return
    # A module called twice (the draft's k_norm on context and block keys) is one scope, two calls.
    groups = {f"{scope}#{k}": call for scope, nodes in by_scope.items() for k, call in enumerate(_calls(nodes))}
    # Weights: float initializers of more than one element (axes, exponents and the like are not).
    initializers = {
        i.name for i in graph.initializer if i.data_type in (1, 10, 16) and int(np.prod(i.dims, dtype=np.int64)) > 1
    }
    small = {i.name for i in graph.initializer} - initializers
    scalars = _scalars(graph)
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}
    replace: dict[int, object] = {}  # id(first node of a group) -> fused node
    drop: set[int] = set()
    for scope, nodes in groups.items():
        inside = {id(n) for n in nodes}
        made = {o for n in nodes for o in n.output}
        external = [i for n in nodes for i in n.input if i and i not in made]
        activations = sorted({i for i in external if i not in initializers and i not in small and i not in scalars})
        weights = sorted({i for i in external if i in initializers})
        outputs = [
            o
            for n in nodes
            for o in n.output
            if o in graph_outputs or any(id(c) not in inside for c in consumers.get(o, []))  # noqa: B023
        ]
        eps = [v for name, v in scalars.items() if name in external and not _is_form_constant(v)]
        if len(activations) != 1 or len(weights) != 1 or len(outputs) != 1 or len(eps) != 1:
            result.skipped.append(f"{scope}: inputs {activations + weights}, outputs {outputs}, eps {eps}")
            continue
        fused = helper.make_node(
            "SimplifiedLayerNormalization",
            [activations[0], weights[0]],
            [outputs[0]],
            name=f"{scope}/SimplifiedLayerNormalization",
            axis=-1,
            epsilon=eps[0] ** 2,  # the graph holds sqrt(eps) (see rms_normalize)
            stash_type=1,  # float32 statistics, as the traced form computed them
        )
        replace[id(nodes[0])] = fused
        drop |= inside
        result.norms += 1
    kept = []
    for node in graph.node:
        if id(node) in replace:
            kept.append(replace[id(node)])
        elif id(node) not in drop:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)


def _calls(nodes: list) -> list[list]:
    """Split one scope's nodes into connected pieces (nodes linked by a tensor one makes and one reads)."""
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    maker = {o: i for i, n in enumerate(nodes) for o in n.output}
    for i, n in enumerate(nodes):
        for name in n.input:
            if name in maker:
                parent[root(i)] = root(maker[name])
    pieces: dict[int, list] = {}
    for i, n in enumerate(nodes):
        pieces.setdefault(root(i), []).append(n)
    return list(pieces.values())


def _is_form_constant(value: float) -> bool:
    return any(abs(value - c) <= 1e-12 * max(1.0, abs(c)) for c in _FORM_CONSTANTS)


def _drop_v_guards(graph, result: FuseResult) -> None:
    """Where(live, V, 0) whose every reader is a MatMul taking it as its second input -> V."""
    from onnx import numpy_helper

    zeros = set()
    for init in graph.initializer:
        if init.data_location != 1 and int(np.prod(init.dims, dtype=np.int64)) <= 1:
            if not np.any(numpy_helper.to_array(init)):
                zeros.add(init.name)
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].type == 4:
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.size <= 1 and value.dtype.kind == "f" and not np.any(value):
                zeros.add(node.output[0])
    readers: dict[str, list] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    graph_outputs = {o.name for o in graph.output}
    guards = []
    for node in graph.node:
        if node.op_type != "Where" or len(node.input) != 3 or node.input[2] not in zeros:
            continue
        out = node.output[0]
        uses = readers.get(out, [])
        if uses and out not in graph_outputs and all(r.op_type == "MatMul" and i == 1 for r, i in uses):
            guards.append(node)
    for guard in guards:
        for reader, i in readers[guard.output[0]]:
            reader.input[i] = guard.input[1]
        graph.node.remove(guard)
        result.v_guards += 1


def _fuse_silu(model, result: FuseResult) -> None:
    """Mul(x, Sigmoid(x)) -> com.microsoft QuickGelu(x, alpha=1.0), which computes x * sigmoid(alpha * x).

    Elementwise, so every position stays independent of the others in its call. With the pad merge of
    ortcompile/gqa.py: T(1) 0.992x (int4) and 0.974x (fp32) on the 0.6B-shaped target, same outputs
    (benchmarks/results/ort-runtime/step-ab-s9-*.json)."""
    from onnx import helper

    graph = model.graph
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}
    replace: dict[int, object] = {}
    drop: set[int] = set()
    for node in graph.node:
        if node.op_type != "Sigmoid" or node.output[0] in graph_outputs:
            continue
        x, s = node.input[0], node.output[0]
        users = readers.get(s, [])
        if len(users) != 1 or users[0].op_type != "Mul" or sorted(users[0].input) != sorted([x, s]):
            continue
        mul = users[0]
        replace[id(mul)] = helper.make_node(
            "QuickGelu", [x], [mul.output[0]], name=f"{node.name or x}/QuickGelu", domain="com.microsoft", alpha=1.0
        )
        drop.add(id(node))
    if not replace:
        return
    kept = [replace.get(id(n), n) for n in graph.node if id(n) not in drop]
    del graph.node[:]
    graph.node.extend(kept)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    result.silu = len(replace)


def model_ops(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts
