"""The exported `dflash.delta` nodes (modeling/delta_scan.py) as ONNX `Scan`s over the row axis.

Both bodies write the state update as the same nodes, Mul(state, exp(g)) then Add of the outer product
k u^T (one product per entry: nothing to sum), on tensors of one row's shape: a row of a long call, a
one-token call and a fold at the next call give the same bits.
"""

from __future__ import annotations

import itertools

from dflash_cli.modeling.delta_scan import DOMAIN

_ROW_AXIS = 2  # q, k, v, u [B, Hv, T, d] and g, beta [B, Hv, T]
_TAKE_AXIS = 1  # take [B, R]


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
    """(state, q, k, v, g, beta) -> (state, o, u) for one row."""
    from onnx import TensorProto, helper

    n = helper.make_node
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
        n("Identity", [p + "s"], [p + "s_out"]),
    ]
    ins = [helper.make_tensor_value_info(p + x, TensorProto.FLOAT, None) for x in ("s_in", "q", "k", "v", "g", "beta")]
    outs = [helper.make_tensor_value_info(p + x, TensorProto.FLOAT, None) for x in ("s_out", "o", "u")]
    return helper.make_graph([*_axes(p), *decay, *mem, *write, *read], p + "rows", ins, outs)


def fold_body(p: str):
    """(state, k, u, g, take) -> state after the row if taken, else as it was."""
    from onnx import TensorProto, helper

    n = helper.make_node
    decay, write = _update(n, p + "s_in", p)
    keep = [
        n("Constant", [], [p + "ax123"], value_ints=[1, 2, 3]),
        n("Unsqueeze", [p + "take", p + "ax123"], [p + "take4"]),
        n("Where", [p + "take4", p + "s", p + "s_in"], [p + "s_out"]),
    ]
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info(p + x, f, None) for x in ("s_in", "k", "u", "g")]
    ins.append(helper.make_tensor_value_info(p + "take", TensorProto.BOOL, None))
    outs = [helper.make_tensor_value_info(p + "s_out", f, None)]
    return helper.make_graph([*_axes(p), *decay, *write, *keep], p + "fold", ins, outs)


def expand_scans(model) -> int:
    """Replace every `dflash.delta` node of the onnx_ir `model`'s main graph by its Scan; returns how many."""
    import onnx_ir as ir

    graph, count = model.graph, itertools.count()
    done = 0
    for node in list(graph):
        if node.domain != DOMAIN:
            continue
        p = f"delta_scan{next(count)}/"
        if node.op_type == "DeltaRows":
            body, axes, outs, n_out = rows_body(p), [_ROW_AXIS] * 5, [_ROW_AXIS] * 2, 3
        elif node.op_type == "DeltaFold":
            body, axes, outs, n_out = fold_body(p), [_ROW_AXIS] * 3 + [_TAKE_AXIS], [], 1
        else:
            raise ValueError(f"unknown {DOMAIN} op {node.op_type}")
        scan = ir.Node(
            "",
            "Scan",
            inputs=list(node.inputs),
            attributes=[
                ir.AttrGraph("body", ir.from_proto(body)),
                ir.AttrInt64("num_scan_inputs", len(axes)),
                ir.AttrInt64s("scan_input_axes", axes),
                *([ir.AttrInt64s("scan_output_axes", outs)] if outs else []),
            ],
            num_outputs=n_out,
            name=p + "scan",
        )
        graph.insert_before(node, scan)
        new = scan.outputs[1:] if node.op_type == "DeltaRows" else scan.outputs
        for old, value in zip(node.outputs, new):
            name, old.name = old.name, None
            value.name, value.shape, value.type = name, old.shape, old.type
            ir.convenience.replace_all_uses_with(old, value, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        done += 1
    model.opset_imports.pop(DOMAIN, None)
    return done
