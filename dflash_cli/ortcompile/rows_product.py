"""compile.ort.precision w8a8: int8 weights times each activation row quantised on its own, summed as integers.

A projection becomes one `RowsMatMul` node, a function local to the model that ONNX Runtime inlines at load:

    s = max(|x|) / 127 over the row's inputs      (one scale per row, computed in the graph)
    q = round(x / s) + 128                        (uint8)
    y = MatMulInteger(q, W, 128) * s * w_scale    (int32 sums, then one float scale per row and column)

The integer sums are exact whatever the kernel, the tiling or the number of rows, and the row's scale is
its own: a position's output cannot depend on the other rows of the call, so verify blocks, one-token calls
and batches agree bit for bit by construction. ONNX Runtime's u8 x s8 kernel sums on integers without
the saturation AVX2's 16-bit pair products would add (`vpmaddubsw`) only while each pair stays below
2^15: weights are kept to 7 bits ([-63, 63], one scale per output column), so 2 x 255 x 63 fits, on
every instruction set. Measured on this AVX2 machine: with full-range int8 weights every sum was wrong.

One node per projection (not the chain) keeps the rewrites after this one (ortcompile/gqa.py, row_pads.py)
reading a projection as they read `MatMul` and `MatMulNBits`: input 0 the activations, input 1 the weight.
"""

from __future__ import annotations

import numpy as np

from dflash_cli.ortcompile.transpose import transposed as contiguous_t

DOMAIN = "dflash.rows"
OP = "RowsMatMul"
WEIGHT_LEVELS = 63  # 7-bit weight codes: a u8 x s8 pair product sum never saturates int16 (see above)
CHUNK_ROWS = 4096  # output columns quantised at a time: a 151936-row lm_head never held whole in fp32


def quantize_columns(w: np.ndarray, transposed: bool) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 7-bit codes with one scale per output column: codes [K, N] int8, scales [N] float32.
    `w` is [N, K] (nn.Linear's layout) when `transposed`, else [K, N]."""
    rows = w if transposed else w.T  # [N, K]: one output column per row
    N, K = rows.shape
    codes = np.empty((N, K), dtype=np.int8)
    scales = np.empty(N, dtype=np.float32)
    for start in range(0, N, CHUNK_ROWS):
        part = np.asarray(rows[start : start + CHUNK_ROWS], dtype=np.float32)
        peak = np.abs(part).max(axis=1)
        scale = np.where(peak > 0, peak / WEIGHT_LEVELS, 1.0).astype(np.float32)
        codes[start : start + len(part)] = np.clip(np.rint(part / scale[:, None]), -WEIGHT_LEVELS, WEIGHT_LEVELS)
        scales[start : start + len(part)] = scale
    return contiguous_t(codes), scales


def rows_node(x: str, outputs: list[str], name: str, weight: str, scales: str):
    from onnx import helper

    return helper.make_node(OP, [x, weight, scales], outputs, name=name, domain=DOMAIN)


def add_function(model) -> None:
    """Declare RowsMatMul in `model` (once) and import its domain."""
    from onnx import helper

    if any(f.name == OP and f.domain == DOMAIN for f in model.functions):
        return
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 21)
    model.functions.append(_function(opset))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def _function(opset: int):
    """The body, in the model's own opset (ONNX Runtime inlines a function only in its model's opset)."""
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, value) -> object:
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name))

    nodes = [
        const("last", np.array([-1], np.int64)),
        const("tiny", np.array(1e-30, np.float32)),  # an all-zero row (padding) gets codes of 0, not NaN
        const("levels", np.array(127.0, np.float32)),
        const("one", np.array(1.0, np.float32)),
        const("mid", np.array(128, np.uint8)),
        helper.make_node("Abs", ["x"], ["magnitude"]),
        # axes became an input in opset 18
        helper.make_node("ReduceMax", ["magnitude", "last"], ["peak"], keepdims=1)
        if opset >= 18
        else helper.make_node("ReduceMax", ["magnitude"], ["peak"], keepdims=1, axes=[-1]),
        helper.make_node("Max", ["peak", "tiny"], ["bounded"]),
        helper.make_node("Div", ["bounded", "levels"], ["row_scale"]),
        helper.make_node("Div", ["x", "row_scale"], ["scaled"]),
        helper.make_node("QuantizeLinear", ["scaled", "one", "mid"], ["codes"]),
        helper.make_node("MatMulInteger", ["codes", "w", "mid"], ["sums"]),
        helper.make_node("Cast", ["sums"], ["sums_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["sums_f", "row_scale"], ["by_row"]),
        helper.make_node("Mul", ["by_row", "w_scale"], ["y"]),
    ]
    return helper.make_function(
        DOMAIN,
        OP,
        ["x", "w", "w_scale"],
        ["y"],
        nodes,
        opset_imports=[helper.make_opsetid("", opset)],
    )
