"""The exported `dflash.delta` nodes as ONNX `Scan`s over a call's rows: every row computed on tensors of one
row's shape, so a row of a long call gives what a one-token call gives, bit for bit.

DeltaRows / DeltaFold (modeling/delta_scan.py): both bodies write the state update as the same nodes,
Mul(state, exp(g)) then Add of the outer product k u^T (one product per entry: nothing to sum), so a fold
at the next call repeats a row's update exactly. RowAttention (modeling/row_attention.py): each row reads
K and V from the outer graph, sliced to the slots it sees.
"""

from __future__ import annotations

import itertools

from dflash_cli.modeling.delta_scan import DOMAIN

_ROW_AXIS = 2  # q, k, v, u [B, Hv, T, d] and g, beta [B, Hv, T]
_TAKE_AXIS = 1  # take [B, R], valid and positions [B, T]


def _update(n, s_in: str, p: str) -> tuple[list, list]:
    """Nodes from `s_in` and the row's g, k, u to p+'s' = exp(g) s_in + k u^T: (the decay to p+'sd', the write)."""
    return [
        n("Exp", [p + "g"], [p + "e"]),
        n("Unsqueeze", [p + "e", p + "ax23"], [p + "e4"]),
        n("Mul", [s_in, p + "e4"], [p + "sd"]),
    ], [
        n("Unsqueeze", [p + "k", p + "ax3"], [p + "kcol"]),
        n("Unsqueeze", [p + "u", p + "ax2"], [p + "urow"]),
        n("Mul", [p + "kcol", p + "urow"], [p + "outer"]),
        n("Add", [p + "sd", p + "outer"], [p + "s"]),
    ]


def _axes(p: str) -> list:
    from onnx import helper

    return [
        helper.make_node("Constant", [], [p + name], value_ints=vals)
        for name, vals in (("ax2", [2]), ("ax3", [3]), ("ax23", [2, 3]))
    ]


def rows_body(p: str):
    """(state, rate, q, k, v, a, b, valid) -> (state, rate, o, u, g) for one row: the gates' activations too
    (modeling/delta_scan.row_gates), on the row's own [B, Hv]; `rate` rides along as loop state, unchanged."""
    from onnx import TensorProto, helper

    n = helper.make_node
    gates = [
        n("Constant", [], [p + "zero"], value_float=0.0),
        n("Constant", [], [p + "ax1"], value_ints=[1]),
        n("Unsqueeze", [p + "valid", p + "ax1"], [p + "valid2"]),
        n("Softplus", [p + "a"], [p + "soft"]),
        n("Mul", [p + "rate", p + "soft"], [p + "g0"]),
        n("Where", [p + "valid2", p + "g0", p + "zero"], [p + "g"]),
        n("Sigmoid", [p + "b"], [p + "beta0"]),
        n("Where", [p + "valid2", p + "beta0", p + "zero"], [p + "beta"]),
        n("Identity", [p + "rate"], [p + "rate_out"]),
    ]
    decay, write = _update(n, p + "s_in", p)
    mem = [
        n("Unsqueeze", [p + "k", p + "ax2"], [p + "krow"]),
        n("MatMul", [p + "krow", p + "sd"], [p + "mem4"]),
        n("Squeeze", [p + "mem4", p + "ax2"], [p + "mem"]),
        n("Sub", [p + "v", p + "mem"], [p + "diff"]),
        n("Unsqueeze", [p + "beta", p + "ax2"], [p + "b3"]),
        n("Mul", [p + "diff", p + "b3"], [p + "u"]),
    ]
    read = [
        n("Unsqueeze", [p + "q", p + "ax2"], [p + "qrow"]),
        n("MatMul", [p + "qrow", p + "s"], [p + "o4"]),
        n("Squeeze", [p + "o4", p + "ax2"], [p + "o"]),
    ]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(p + x, f, None) for x in ("s_in", "rate", "q", "k", "v", "a", "b")]
    ins.append(helper.make_tensor_value_info(p + "valid", TensorProto.BOOL, None))
    outs = [helper.make_tensor_value_info(p + x, f, None) for x in ("s", "rate_out", "o", "u", "g")]
    return helper.make_graph([*_axes(p), *gates, *decay, *mem, *write, *read], p + "rows", ins, outs)


def fold_body(p: str):
    """(state, k, u, g, take) -> state after the row if taken, else as it was: a row not taken gets g = 0 and
    u = 0, so the update is state * 1 + k 0^T, the state itself (masking the row's vectors, not the state, reads
    and writes the state once less)."""
    from onnx import TensorProto, helper

    n = helper.make_node
    decay, write = _update(n, p + "s_in", p)
    masks = [
        n("Constant", [], [p + "zero"], value_float=0.0),
        n("Constant", [], [p + "ax1"], value_ints=[1]),
        n("Unsqueeze", [p + "take", p + "ax1"], [p + "take2"]),
        n("Unsqueeze", [p + "take2", p + "ax2"], [p + "take3"]),
        n("Where", [p + "take2", p + "g_in", p + "zero"], [p + "g"]),
        n("Where", [p + "take3", p + "u_in", p + "zero"], [p + "u"]),
    ]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(p + x, f, None) for x in ("s_in", "k", "u_in", "g_in")]
    ins.append(helper.make_tensor_value_info(p + "take", TensorProto.BOOL, None))
    outs = [helper.make_tensor_value_info(p + "s", f, None)]
    return helper.make_graph([*_axes(p), *masks, *decay, *write], p + "fold", ins, outs)


def attention_body(node, p: str):
    """The RowAttention `node`'s body (onnx_ir, reading its K and V from the outer graph): one query row
    q [b, h, d] at position pos [b] -> [b, h, d] over slots 0 .. pos (batch 1: the slice is row 0's)."""
    import numpy as np
    import onnx_ir as ir

    q_in, k, v, pos_in = node.inputs
    h, d = q_in.shape[1], q_in.shape[3]
    kvh = k.shape[1]
    elem = q_in.type
    nodes = []

    def add(op, inputs, **attrs):
        made = ir.node(op, inputs, attributes=attrs, name=f"{p}{op}{len(nodes)}")
        nodes.append(made)
        return made.outputs[0]

    def const(values, dtype=np.int64):
        return add("Constant", [], value=ir.tensor(np.asarray(values, dtype=dtype)))

    q = ir.Value(name=p + "q", type=elem)
    pos = ir.Value(name=p + "pos", type=ir.TensorType(ir.DataType.INT64))
    grouped = add("Reshape", [q, const([0, kvh, h // kvh, d])])
    first = add("Slice", [pos, const([0]), const([1])])  # [1]: the sequence's (batch 1) position
    end = add("Add", [add("Max", [first, const([0])]), const([1])])
    zero, axis = const([0]), const([2])
    keys = add("Slice", [k, zero, end, axis])
    values = add("Slice", [v, zero, end, axis])
    scores = add("MatMul", [grouped, add("Transpose", [keys], perm=[0, 1, 3, 2])])
    scale = add("CastLike", [const(node.attributes["scale"].as_float(), np.float32), scores])
    probs = add("Softmax", [add("Mul", [scores, scale])], axis=-1)
    out = add("Reshape", [add("MatMul", [probs, values]), const([0, h, d])])
    return ir.Graph([q, pos], [out], nodes=nodes, name=p + "attention")


def expand_scans(model) -> int:
    """Replace every `dflash.delta` node of the onnx_ir `model`'s main graph by its Scan; returns how many."""
    import onnx_ir as ir

    graph, count = model.graph, itertools.count()
    done = 0
    for node in list(graph):
        if node.domain != DOMAIN:
            continue
        p = f"delta_scan{next(count)}/"
        inputs = list(node.inputs)
        if node.op_type == "DeltaRows":  # (state, rate) carried; q, k, v, a, b and valid scanned
            body, axes, outs, n_out = ir.from_proto(rows_body(p)), [_ROW_AXIS] * 5 + [_TAKE_AXIS], [_ROW_AXIS] * 3, 5
            inputs = [inputs[0], inputs[6], *inputs[1:6], inputs[7]]
        elif node.op_type == "DeltaFold":
            body, axes, outs, n_out = ir.from_proto(fold_body(p)), [_ROW_AXIS] * 3 + [_TAKE_AXIS], [], 1
        elif node.op_type == "RowAttention":  # q [b, h, s, d] and positions [b, s] scanned; K, V read whole
            body, axes, outs, n_out = attention_body(node, p), [_ROW_AXIS, _TAKE_AXIS], [_ROW_AXIS], 1
            inputs = [inputs[0], inputs[3]]
        else:
            raise ValueError(f"unknown {DOMAIN} op {node.op_type}")
        scan = ir.Node(
            "",
            "Scan",
            inputs=inputs,
            attributes=[
                ir.AttrGraph("body", body),
                ir.AttrInt64("num_scan_inputs", len(axes)),
                ir.AttrInt64s("scan_input_axes", axes),
                *([ir.AttrInt64s("scan_output_axes", outs)] if outs else []),
            ],
            num_outputs=n_out,
            name=p + "scan",
        )
        graph.insert_before(node, scan)
        new = scan.outputs[2:] if node.op_type == "DeltaRows" else scan.outputs  # not the rows' final state
        for old, value in zip(node.outputs, new):
            name, old.name = old.name, None
            value.name, value.shape, value.type = name, old.shape, old.type
            ir.convenience.replace_all_uses_with(old, value, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        done += 1
    model.opset_imports.pop(DOMAIN, None)
    return done
