"""One padding row per layer instead of three: the single-row padding of q, k and v moved above their Split.

The attention rewrite (ortcompile/gqa.py) pads each layer's q, k and v to at least two rows (a one-token
call attends as two). Where the three come from one Split (the stacked q/k/v MatMulNBits of an int8/int4
compile) through per-head norms and reshapes only, padding the Split's input once does the same with one
node. The reshapes on the way then see the padded row count: a shape that spells out the call's length
(a graph with a symbolic batch has two unknown dims, so the exporter cannot write -1 for one of them) is
rewritten to take the length from the tensor (-1).
"""

from __future__ import annotations

MINUS_ONE = "row_pads.minus_one"


def merge_row_pads(graph) -> int:
    """Where a layer's q, k and v come from one Split (the stacked q/k/v MatMulNBits of an int8/int4
    compile) through per-head norms and reshapes only, pad the Split's input once instead of q, k and v
    each: one node instead of three, and the norms see the padding row as a copy of the real one (edge
    mode), which they treat like any row. Only where every tensor on the way has a single reader, so no
    other node sees the extra row. Returns the layers merged."""
    import numpy as np
    from onnx import helper, numpy_helper

    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    outputs = {o.name for o in graph.output}

    def sole_reader(name: str, node) -> bool:
        return name not in outputs and len(readers.get(name, [])) == 1 and readers[name][0] is node

    def reader_of(name: str):
        users = readers.get(name, [])
        return users[0] if len(users) == 1 else None

    def split_above(pad):
        """The Split `pad`'s input comes from through single-reader Reshape / norm chains, or None."""
        node, below = producers.get(pad.input[0]), pad
        while node is not None and node.op_type in ("Reshape", "SimplifiedLayerNormalization"):
            if not sole_reader(node.output[0], below):
                return None
            node, below = producers.get(node.input[0]), node
        if node is None or node.op_type != "Split" or not all(sole_reader(o, reader_of(o)) for o in node.output):
            return None
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        return node if axis in (-1, 2) else None  # split along the features of [1, rows, features]

    drop: set[int] = set()
    before: dict[int, object] = {}
    for gqa in [n for n in graph.node if n.op_type == "GroupQueryAttention"]:
        pads = [producers.get(name) for name in gqa.input[:3]]
        if not all(p is not None and p.op_type == "Pad" and sole_reader(p.output[0], gqa) for p in pads):
            continue
        found = [split_above(p) for p in pads]
        split = found[0]
        if split is None or any(s is not split for s in found):
            continue
        src = split.input[0]
        if src in outputs or len(readers.get(src, [])) != 1:
            continue
        rows = f"{src}.rows"
        before[id(split)] = [helper.make_node("Pad", [src, pads[0].input[1]], [rows], mode="edge")]
        split.input[0] = rows
        for j, pad in enumerate(pads):
            gqa.input[j] = pad.input[0]
            drop.add(id(pad))
            node = producers.get(pad.input[0])
            while node is not split:  # the chain's reshapes now see the padded rows
                shape = producers.get(node.input[1]) if node.op_type == "Reshape" else None
                if shape is not None and shape.op_type == "Concat" and len(shape.input) == 4:
                    free = helper.make_node(
                        "Concat", [shape.input[0], MINUS_ONE, *shape.input[2:]], [f"{node.input[1]}.rows_free"], axis=0
                    )
                    before.setdefault(id(node), []).append(free)
                    node.input[1] = free.output[0]
                node = producers.get(node.input[0])
    if not before:
        return 0
    merged = sum(n.op_type == "Split" for n in graph.node if id(n) in before)
    kept = []
    for node in graph.node:
        if id(node) in drop:
            continue
        kept += before.get(id(node), [])
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    if any(MINUS_ONE in n.input for n in kept):
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), MINUS_ONE))
    return merged
