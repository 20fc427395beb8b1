"""Grow a graph traced with one decoder layer into the real depth by copying that layer's nodes.

Tracing costs ~2 s per decoder layer and graph on two cores (torch.export, decompositions, ONNX
translation) and the exporter's clean-up grows faster than linearly, so a 28-layer graph took
minutes while every layer traces to the same nodes. The export therefore traces the model with one
layer and copies it here, in the ONNX IR, once per further layer, with that layer's weights, cache
inputs and cache outputs, each copy reading the previous copy's output.

What belongs to the layer is found from data flow: every node that depends on a layer-0 source
(its weights, its `past_*.0` cache inputs, or the hidden state entering it) and not on the hidden
state leaving it. Nodes of the layer that depend on none of those (the attention mask, say) are
shared by all copies. The hidden state entering is what the embedding module's nodes hand to the
layer; the one leaving is what the final norm's nodes read. Anything else that reads the layer from
outside (the target's feature taps) is rewired explicitly; any shape of graph this code does not
expect raises `ReplicationError`, and the caller traces the whole model instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dflash_cli.errors import DFlashError
from dflash_cli.exporting.external_data import Initializer
from dflash_cli.exporting.names import SCOPES_KEY, WRAPPER_PREFIX
from dflash_cli.exporting.torch_to_onnx import lazy_weight

_PAST = re.compile(r"^past_(key|value)\.0$")
_CACHE_OUT = re.compile(r"^(past|present)_(key|value)\.0(_RetainedState)?$")


class ReplicationError(Exception):
    """The traced graph is not shaped as replication expects (the caller falls back to a full trace)."""


@dataclass(frozen=True)
class LayerPlan:
    num_layers: int  # depth of the real model
    layers_prefix: str  # parameter path of the layer list: "model.layers." or "draft.layers."
    embed_scope: str  # module path of the embedding ("model.embed_tokens")
    norm_scope: str  # module path of the final norm ("model.norm")
    input_names: tuple[str, ...]  # the real model's graph inputs and outputs, in order
    output_names: tuple[str, ...]
    taps: tuple[int, ...] = ()  # the real layers whose output a Concat reads (the target's features)
    # Layers that attend to every position while the traced layer 0 has a sliding window (gpt-oss
    # alternates them): their copies read the full mask the window mask is cut from.
    full_layers: frozenset[int] = frozenset()


def grow_layers(model, plan: LayerPlan, sources: dict[str, Initializer], by_graph_name: dict[str, Initializer]) -> None:
    """Copy the traced layer 0 of `model` to `plan.num_layers` layers, each copy's weights
    read lazily from `sources`; records them in `by_graph_name` for the writer."""
    import onnx_ir as ir

    def weight_value(name: str, like):
        tmpl = like.const_value
        src = sources.get(name)
        if src is None:
            raise DFlashError(f"export: no weights for {name}", hint="this is a dflash bug")
        value = ir.Value(
            name=WRAPPER_PREFIX + name,
            type=like.type,
            shape=like.shape,
            const_value=lazy_weight(src, tmpl.dtype, tuple(tmpl.shape), name),
        )
        model.graph.register_initializer(value)
        by_graph_name[value.name] = src
        return value

    replicate_layers(model, plan, weight_value)


def replicate_layers(model, plan: LayerPlan, weight_value) -> None:
    """Copy layer 0 of `model` (onnx_ir, traced with one layer) into layers 1..num_layers-1, in place.

    `weight_value(name, like)` returns the initializer value for weight `name` (without the wrapper
    prefix), shaped like the template's `like`.
    """
    graph = model.graph
    nodes = list(graph)
    layer0 = _Layer0.find(graph, nodes, plan)
    window = _WindowMask(graph, nodes, layer0.nodes, layer0.produced) if plan.full_layers else None
    inputs = {v.name: v for v in graph.inputs}
    outputs = {v.name: v for v in graph.outputs}
    copier = _Copier(graph, plan, layer0, window, weight_value, inputs, outputs)
    outs = [layer0.chain_out]  # each layer's output: layer k + 1 reads outs[k]
    for k in range(1, plan.num_layers):
        outs.append(copier.copy(k, outs[-1]))

    _rewire(layer0.outside_reads, plan, outs)
    missing = [x for x in plan.input_names if x not in inputs] + [x for x in plan.output_names if x not in outputs]
    if missing:
        raise ReplicationError(f"graph names missing after replication: {missing[:4]}")
    graph.inputs[:] = [inputs[x] for x in plan.input_names]
    graph.outputs[:] = [outputs[x] for x in plan.output_names]
    graph.sort()


@dataclass(frozen=True)
class _Layer0:
    """The traced layer 0, found from data flow (the module docstring)."""

    prefix: str  # its parameters' path, "model.layers.0."
    nodes: list  # its nodes, in graph order (the template every copy follows)
    produced: set  # the values they produce
    weights: set  # its weight initializers
    pasts: set  # its past_*.0 cache inputs
    chain_in: Any  # the hidden state entering it
    chain_out: Any  # the hidden state leaving it
    cache_outs: list  # its cache outputs among the graph's outputs
    outside_reads: list[tuple[Any, int]]  # (node, input slot) outside the layer reading chain_out

    @classmethod
    def find(cls, graph, nodes: list, plan: LayerPlan) -> _Layer0:
        prefix = plan.layers_prefix + "0."
        weights = {v for v in graph.initializers.values() if v.name.removeprefix(WRAPPER_PREFIX).startswith(prefix)}
        pasts = {v for v in graph.inputs if _PAST.match(v.name)}
        chain_in = _single(_crossing(nodes, plan.embed_scope, leaving=True), "hidden state entering layer 0")
        chain_out = _single(_crossing(nodes, plan.norm_scope, leaving=False), "hidden state leaving layer 0")
        template = _template(nodes, set(weights) | pasts | {chain_in}, chain_out)
        inside = set(template)
        produced = {v for node in template for v in node.outputs}

        # Who reads the layer from outside: the final norm and a taps Concat (chain_out only), and the
        # graph outputs (layer 0's own cache outputs only).
        outside_reads = []
        for node in nodes:
            if node in inside:
                continue
            for i, v in enumerate(node.inputs):
                if v in produced:
                    if v is not chain_out:
                        raise ReplicationError(f"{node.name} reads {v.name} from inside layer 0")
                    outside_reads.append((node, i))
        cache_outs = [v for v in graph.outputs if v in produced]
        if any(not _CACHE_OUT.match(v.name) for v in cache_outs) or len(cache_outs) != len(pasts):
            raise ReplicationError(f"layer 0's graph outputs are not its caches: {[v.name for v in cache_outs]}")
        return cls(prefix, template, produced, weights, pasts, chain_in, chain_out, cache_outs, outside_reads)


def _template(nodes: list, layer_sources: set, chain_out) -> list:
    """The nodes that depend on a layer-0 source and not on the hidden state leaving the layer."""
    import onnx_ir as ir

    layer_dep: set = set(layer_sources)
    tail_dep: set = {chain_out}
    template = []
    for node in nodes:
        ins = [v for v in node.inputs if v is not None]
        if any(v in tail_dep for v in ins):
            tail_dep.update(node.outputs)
        elif any(v in layer_dep for v in ins):
            layer_dep.update(node.outputs)
            template.append(node)
        if any(a.type == ir.AttributeType.GRAPH or a.type == ir.AttributeType.GRAPHS for a in node.attributes.values()):
            raise ReplicationError(f"node {node.name} has subgraphs")
    if chain_out.producer() not in template:
        raise ReplicationError("the final norm does not read layer 0's output")
    return template


@dataclass
class _Copier:
    """Appends copies of layer 0 to the graph: renamed nodes, layer k's weights and caches."""

    graph: Any
    plan: LayerPlan
    layer0: _Layer0
    window: _WindowMask | None  # where layer 0 cuts its window mask (plan.full_layers only)
    weight_value: Callable
    inputs: dict[str, Any]  # the graph's inputs by name; the copies' cache inputs are added
    outputs: dict[str, Any]  # the graph's outputs by name; the copies' cache outputs are added

    def copy(self, k: int, chain_in) -> Any:
        """Layer k, reading `chain_in`; returns the hidden state leaving it."""
        import onnx_ir as ir

        layer0, window = self.layer0, self.window
        mapping = {layer0.chain_in: chain_in}
        full = k in self.plan.full_layers
        if full:
            mapping.update(window.outside)
        for v in layer0.pasts:
            mapping[v] = self.inputs[_layer_name(v.name, k)] = _new_input(ir, v, _layer_name(v.name, k))
        for node in layer0.nodes:
            if full and node is window.inside:  # the mask it would cut: the full one
                mapping[node.outputs[0]] = mapping.get(node.inputs[0], node.inputs[0])
                continue
            self.graph.append(self._copy_node(node, k, mapping))
        return mapping[layer0.chain_out]

    def _copy_node(self, node, k: int, mapping: dict):
        """`node` for layer k, its inputs mapped (weights made on first use) and its outputs added to `mapping`."""
        import onnx_ir as ir

        layer0 = self.layer0
        args = []
        for v in node.inputs:
            if v is not None and v not in mapping and v in layer0.weights:
                name = v.name.removeprefix(WRAPPER_PREFIX).replace(layer0.prefix, f"{self.plan.layers_prefix}{k}.", 1)
                mapping[v] = self.weight_value(name, v)
            args.append(mapping.get(v, v) if v is not None else None)
        copy = ir.Node(
            node.domain,
            node.op_type,
            args,
            attributes=list(node.attributes.values()),
            overload=node.overload,
            num_outputs=len(node.outputs),
            version=node.version,
            name=f"{node.name}__L{k}",
            metadata_props={key: _rename_scope(val, k) for key, val in node.metadata_props.items()},
        )
        for old, new in zip(node.outputs, copy.outputs):
            new.name = _layer_name(old.name, k) if old in layer0.cache_outs else f"{old.name}__L{k}"
            new.type, new.shape = old.type, old.shape
            mapping[old] = new
            if old in layer0.cache_outs:
                self.outputs[new.name] = new
        return copy


class _WindowMask:
    """Where layer 0 cuts its sliding-window mask from the full mask: `full & near` (modeling/target.py
    writes the full mask first), in one And. Prefix-cache graphs derive the mask from the layer's own
    past, so the And is inside the layer (`inside`): a copy that attends to every position skips it. In
    static graphs the And and what the attention derives from the mask alone (the Where's condition,
    the live slots) sit outside the layer: they are computed once more from the full mask, and such a
    copy reads those values instead (`outside`: layer 0's value -> the full mask's)."""

    def __init__(self, graph, nodes: list, template: list, produced: set) -> None:
        import onnx_ir as ir

        self.inside, self.outside = None, {}
        ands = [n for n in template if n.op_type == "And"]
        if len(ands) > 1:
            raise ReplicationError(f"{len(ands)} And nodes in layer 0: which one cuts its window is unclear")
        if ands:
            self.inside = ands[0]
            self._check(self.inside, ir)
            return
        inside = set(template)
        read = {v for node in template for v in node.inputs if v is not None and v not in produced}
        found = []
        for start in (n for n in nodes if n.op_type == "And" and n not in inside):
            derived, made = [], {start.outputs[0]}
            for node in nodes:  # what outside the layer depends on the mask alone
                if node in inside or node is start or not any(v in made for v in node.inputs):
                    continue
                if any(v in produced for v in node.inputs):
                    continue
                derived.append(node)
                made.update(node.outputs)
            if made & read:
                found.append((start, derived))
        if len(found) != 1:
            raise ReplicationError(f"expected one And cutting layer 0's window mask, found {len(found)}")
        start, derived = found[0]
        self._check(start, ir)
        self.outside = {start.outputs[0]: start.inputs[0]}
        for step in derived:
            copy = ir.Node(
                step.domain,
                step.op_type,
                [self.outside.get(v, v) for v in step.inputs],
                attributes=list(step.attributes.values()),
                overload=step.overload,
                num_outputs=len(step.outputs),
                version=step.version,
                name=f"{step.name}__full",
                metadata_props=dict(step.metadata_props),
            )
            for old, new in zip(step.outputs, copy.outputs):
                new.name, new.type, new.shape = f"{old.name}__full", old.type, old.shape
                self.outside[old] = new
            graph.append(copy)

    @staticmethod
    def _check(node, ir) -> None:
        full = node.inputs[0]
        if full is None or full.dtype != ir.DataType.BOOL:
            raise ReplicationError("layer 0's window mask is not cut from a boolean mask")


def _rewire(reads, plan: LayerPlan, outs: list) -> None:
    """Point the final norm at the last layer's output and each tap at its own layer's output."""
    last = plan.num_layers - 1
    for node in dict.fromkeys(node for node, _ in reads):
        slots = [i for n, i in reads if n is node]
        if plan.norm_scope in _scopes(node):
            for i in slots:
                node.replace_input_with(i, outs[last])
        elif node.op_type == "Concat" and plan.taps:
            want = [j for j, layer in enumerate(plan.taps) if layer != last]
            if slots != want or len(node.inputs) != len(plan.taps):
                raise ReplicationError(f"taps Concat reads layer 0 at {slots}, expected {want}")
            for i in slots:
                node.replace_input_with(i, outs[plan.taps[i]])
        else:
            raise ReplicationError(f"{node.op_type} {node.name} reads layer 0's output")


def _crossing(nodes, scope: str, *, leaving: bool) -> set:
    """Values crossing the boundary of module `scope`: produced inside and read outside (leaving),
    or produced by a node outside and read inside (entering; weights and graph inputs excluded)."""
    found = set()
    for node in nodes:
        in_scope = scope in _scopes(node)
        for v in node.inputs:
            if v is None or v.producer() is None:
                continue
            producer_in = scope in _scopes(v.producer())
            if leaving and producer_in and not in_scope:
                found.add(v)
            if not leaving and in_scope and not producer_in:
                found.add(v)
    return found


def _scopes(node) -> list[str]:
    raw = node.metadata_props.get(SCOPES_KEY, "")
    return [s.removeprefix(WRAPPER_PREFIX) for s in re.findall(r"'([^']*)'", raw)]


def _single(values: set, what: str):
    if len(values) != 1:
        raise ReplicationError(f"expected one {what}, found {sorted(v.name for v in values)}")
    return next(iter(values))


def _layer_name(name: str, k: int) -> str:
    return re.sub(r"\.0(_RetainedState)?$", lambda m: f".{k}{m.group(1) or ''}", name, count=1)


def _rename_scope(value: str, k: int) -> str:
    return re.sub(r"layers\.0(?=[.'\"\]]|$)", f"layers.{k}", value)


def _new_input(ir, like, name: str):
    return ir.Value(name=name, type=like.type, shape=like.shape)
