"""An in-place-cache target graph (ortcompile/gqa.py) that takes n sequences per call, each with its own cache.

ONNX Runtime's GroupQueryAttention refuses a call of several sequences of several tokens each over a
filled cache ("batch_size must be 1 when sequence_length > 1 and past context is given", CPU, 1.32),
which is exactly a batched verify. So this copy splits each layer's attention per sequence: the
weights' products (almost all of a step's time) still run once over every sequence's rows, and each
sequence's attention is one GroupQueryAttention over its own buffers, `past_key.{i}.s{j}` /
`past_value.{i}.s{j}` [1, kv_heads, slots, head_dim], written in place as in the one-sequence graph.
A sequence's cache is then any buffer the caller binds: sequences join and leave a batch without
anything being copied or compacted. The number of sequences is fixed per graph (one per batch size).
"""

from __future__ import annotations

import copy

SEQ = ".s"  # past_key.3.s1: layer 3's keys of the call's second sequence


def seq_name(cache_name: str, j: int) -> str:
    return f"{cache_name}{SEQ}{j}"


def split_sequences(model, n: int):
    """A copy of `model` (an in-place-cache target ModelProto, external data not loaded) for n sequences."""
    import numpy as np
    from onnx import helper, numpy_helper

    out = copy.deepcopy(model)
    graph = out.graph
    gqa = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    if not gqa or n < 2:
        raise ValueError(f"split_sequences: needs GroupQueryAttention nodes and n >= 2 (n={n})")
    seqlens = gqa[0].input[5]
    ones = [f"pseq.ones{n}", "pseq.one32", "pseq.axis0"]
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.ones(n, np.int64), ones[0]),
            numpy_helper.from_array(np.array(1, np.int32), ones[1]),
            numpy_helper.from_array(np.array([0], np.int64), ones[2]),
        ]
    )
    head = [helper.make_node("Split", [seqlens, ones[0]], [f"pseq.seqlens.{j}" for j in range(n)], axis=0)]
    for j in range(n):
        # this sequence's total length alone: its own seqlens_k + 1, as a scalar
        head.append(helper.make_node("Add", [f"pseq.seqlens.{j}", ones[1]], [f"pseq.total1.{j}"]))
        head.append(helper.make_node("Squeeze", [f"pseq.total1.{j}", ones[2]], [f"pseq.total.{j}"]))
    _batch_from_input_ids(graph)
    replaced: dict[int, list] = {}
    for node in gqa:
        nodes = []
        parts = []
        for k in range(3):  # q, k, v [n, rows, features]
            names = [f"{node.input[k]}.s{j}" for j in range(n)]
            nodes.append(helper.make_node("Split", [node.input[k], ones[0]], names, axis=0))
            parts.append(names)
        outs = []
        for j in range(n):
            ins = [parts[0][j], parts[1][j], parts[2][j], seq_name(node.input[3], j), seq_name(node.input[4], j)]
            ins += [f"pseq.seqlens.{j}", f"pseq.total.{j}", *node.input[7:]]
            outs.append(f"{node.output[0]}.s{j}")
            rest = [seq_name(node.output[1], j), seq_name(node.output[2], j)]
            nodes.append(
                helper.make_node(
                    "GroupQueryAttention", ins, [outs[-1], *rest], name=f"{node.name}.s{j}", domain=node.domain
                )
            )
            nodes[-1].attribute.extend(node.attribute)
        nodes.append(helper.make_node("Concat", outs, [node.output[0]], axis=0))
        replaced[id(node)] = nodes
    body = list(head)
    for node in graph.node:
        body += replaced.get(id(node), [node])
    del graph.node[:]
    graph.node.extend(body)
    for values in (graph.input, graph.output):
        kept = []
        for vi in values:
            if not vi.name.startswith(("past_key.", "past_value.", "present_key.", "present_value.")):
                kept.append(vi)
                continue
            dims = [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            elem = vi.type.tensor_type.elem_type
            kept += [helper.make_tensor_value_info(seq_name(vi.name, j), elem, [1, *dims[1:]]) for j in range(n)]
        del values[:]
        values.extend(kept)
    return out


def _batch_from_input_ids(graph) -> None:
    """The exporter may read the batch size off a cache input (`Shape(past_key.0)[0:1]`: every input shares
    the symbol); those inputs are per sequence here, so it reads input_ids' instead."""
    from onnx import helper

    for node in graph.node:
        if node.op_type == "GroupQueryAttention" or not any(i.startswith("past_") for i in node.input):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "Shape" or attrs.get("start", 0) != 0 or attrs.get("end") != 1:
            raise ValueError(f"split_sequences: {node.op_type} {node.name} reads a cache input")
        node.input[0] = "input_ids"
