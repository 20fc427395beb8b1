"""Cost per activation row of ONNX Runtime's integer products against today's int4 `MatMulNBits`, and
whether each form's rows are the same whatever the number of rows in the call (issue 56's lead).

    .venv/bin/python benchmarks/int8_rows_cost.py [--hidden 2560 --inter 9728 --heads 32 --kv 8 --head-dim 128]
        [--layers 4] [--rows 1,2,4,8,16] [--reps 15] [--out F.json]

One decoder layer's projections at the given shape (Qwen3-4B by default: q/k/v stacked, o, gate/up
stacked, down), `--layers` copies, as one graph per form with random weights:

* `nbits`: `MatMulNBits` int4, block 32, accuracy level 4 (int8 activations), as the int4 compile makes;
Weights of the integer forms are 7-bit codes ([-63, 63]): with full-range int8 ones, AVX2's u8 x s8 kernel
saturates its 16-bit pair sums and every value is wrong (ortcompile/rows_product.py); the times are the same.

* `int8-rowq`: each activation row quantised on its own (symmetric int8, scale absmax/127, computed in the
  graph), `MatMulInteger` with int8 weights (one scale per output column), the int32 sums scaled back:
  integer sums are exact, so a row's result cannot depend on the other rows;
* `u8-rowq`: the same with the row shifted to uint8 (zero point 128), the u8 x s8 form MLAS favours;
* `nbits8`: `MatMulNBits` with 8-bit weights (today's int8 precision);
* `u8-group`: `u8-rowq` with one activation scale per row and 256 inputs (and one weight scale per 256
  inputs and column), as a batched `MatMulInteger` over the groups, summed in float over the groups.

Each graph runs at every row count on ONNX Runtime's CPU provider (intra-op threads = cores); medians of
`--reps` calls, ms per call and per added row, effective weight GB/s and integer GOP/s. Invariance: the
first row of an M-row call against a one-row call on the same row, max |diff|.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

GROUP = 256  # u8-group: inputs per activation scale (and per weight scale along K)


def shapes(a: argparse.Namespace) -> list[tuple[int, int]]:
    q, kv = a.heads * a.head_dim, a.kv * a.head_dim
    return [(a.hidden, q + 2 * kv), (q, a.hidden), (a.hidden, 2 * a.inter), (a.inter, a.hidden)]


def graph(kind: str, mats: list[tuple[int, int]], copies: int):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, outs = [], [], []
    if kind == "u8-group":  # each row's groups of GROUP inputs quantised on their own: [K/G, rows, G]
        for k in sorted({k for k, _ in mats}):
            x = f"x{k}"
            inits.append(numpy_helper.from_array(np.array([-1, k // GROUP, GROUP], np.int64), f"{x}_shape"))
            nodes += [
                helper.make_node("Reshape", [x, f"{x}_shape"], [f"{x}_r"]),
                helper.make_node("Transpose", [f"{x}_r"], [f"{x}_t"], perm=[1, 0, 2]),
                helper.make_node("Abs", [f"{x}_t"], [f"{x}_abs"]),
                helper.make_node("ReduceMax", [f"{x}_abs", "last"], [f"{x}_max"], keepdims=1),
                helper.make_node("Max", [f"{x}_max", "tiny"], [f"{x}_m"]),
                helper.make_node("Div", [f"{x}_m", "c127"], [f"{x}_gs"]),
                helper.make_node("Div", [f"{x}_t", f"{x}_gs"], [f"{x}_d"]),
                helper.make_node("QuantizeLinear", [f"{x}_d", "one", "zp"], [f"{x}_gq"]),
            ]
    elif kind not in ("nbits", "nbits8"):  # the row's own scale and int8 codes, once for each input width
        for k in sorted({k for k, _ in mats}):
            x = f"x{k}"
            nodes += [
                helper.make_node("Abs", [x], [f"{x}_abs"]),
                helper.make_node("ReduceMax", [f"{x}_abs", "last"], [f"{x}_max"], keepdims=1),
                helper.make_node("Max", [f"{x}_max", "tiny"], [f"{x}_m"]),
                helper.make_node("Div", [f"{x}_m", "c127"], [f"{x}_s"]),
                helper.make_node("Div", [x, f"{x}_s"], [f"{x}_d"]),
                helper.make_node(
                    "QuantizeLinear",
                    [f"{x}_d", "one", "zp" if kind == "u8-rowq" else "zp8"],
                    [f"{x}_q"],
                ),
            ]
    inits += [
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        numpy_helper.from_array(np.array([0], np.int64), "first"),
        numpy_helper.from_array(np.array(1e-12, np.float32), "tiny"),
        numpy_helper.from_array(np.array(127.0, np.float32), "c127"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(128, np.uint8), "zp"),
        numpy_helper.from_array(np.array(0, np.int8), "zp8"),
    ]
    for c in range(copies):
        for i, (k, n) in enumerate(mats):
            name, x = f"w{c}_{i}", f"x{k}"
            if kind in ("nbits", "nbits8"):
                bits = 4 if kind == "nbits" else 8
                blocks = k // 32
                packed = rng.integers(0, 256, (n, blocks, 32 * bits // 8), dtype=np.uint8)
                scales = (rng.random(n * blocks, dtype=np.float32) + 0.5) * 0.01
                inits += [numpy_helper.from_array(packed, name), numpy_helper.from_array(scales, name + "_s")]
                nodes.append(
                    helper.make_node(
                        "MatMulNBits",
                        [x, name, name + "_s"],
                        [name + "_y"],
                        domain="com.microsoft",
                        K=k,
                        N=n,
                        bits=bits,
                        block_size=32,
                        accuracy_level=4,
                    )
                )
            elif kind == "u8-group":
                g = GROUP
                w = rng.integers(-63, 64, (k // g, g, n), dtype=np.int8)
                col = (rng.random((k // g, 1, n), dtype=np.float32) + 0.5) * 0.001
                inits += [numpy_helper.from_array(w, name), numpy_helper.from_array(col, name + "_c")]
                nodes += [
                    helper.make_node("MatMulInteger", [f"{x}_gq", name, "zp"], [name + "_i"]),
                    helper.make_node("Cast", [name + "_i"], [name + "_f"], to=TensorProto.FLOAT),
                    helper.make_node("Mul", [name + "_f", f"{x}_gs"], [name + "_r"]),
                    helper.make_node("Mul", [name + "_r", name + "_c"], [name + "_p"]),
                    helper.make_node("ReduceSum", [name + "_p", "first"], [name + "_y"], keepdims=0),
                ]
            else:
                w = rng.integers(-63, 64, (k, n), dtype=np.int8)
                col = (rng.random(n, dtype=np.float32) + 0.5) * 0.001
                inits += [numpy_helper.from_array(w, name), numpy_helper.from_array(col, name + "_c")]
                azp = "zp" if kind == "u8-rowq" else "zp8"
                nodes += [
                    helper.make_node("MatMulInteger", [f"{x}_q", name, azp], [name + "_i"]),
                    helper.make_node("Cast", [name + "_i"], [name + "_f"], to=TensorProto.FLOAT),
                    helper.make_node("Mul", [name + "_f", f"{x}_s"], [name + "_r"]),
                    helper.make_node("Mul", [name + "_r", name + "_c"], [name + "_y"]),
                ]
            outs.append(helper.make_tensor_value_info(name + "_y", TensorProto.FLOAT, None))
    inputs = [
        helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["rows", k]) for k in sorted({k for k, _ in mats})
    ]
    g = helper.make_graph(nodes, kind, inputs, outs, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(g, opset_imports=opsets)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--inter", type=int, default=9728)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kinds", default="nbits,nbits8,u8-rowq,u8-group")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import onnx
    import onnxruntime as ort

    mats = shapes(args)
    macs_per_row = sum(k * n for k, n in mats) * args.layers
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(1)
    widths = sorted({k for k, _ in mats})
    feeds = {m: {f"x{k}": rng.standard_normal((m, k), dtype=np.float32) for k in widths} for m in rows}
    for m in rows:  # every call's first row is the same row
        for k in widths:
            feeds[m][f"x{k}"][0] = feeds[rows[0]][f"x{k}"][0]
    report: dict = {"shape": {k: str(v) for k, v in vars(args).items()}, "macs_per_row": macs_per_row, "kinds": {}}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory() as tmp:  # external data: 36 layers are over protobuf's 2 GB
            path = Path(tmp) / f"{kind}.onnx"
            onnx.save_model(graph(kind, mats, args.layers), str(path), save_as_external_data=True)
            sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        weight_bytes = macs_per_row * {"nbits": 0.5 + 4 / 32, "nbits8": 1 + 4 / 32}.get(kind, 1)
        first = None
        by_rows = {}
        for m in rows:
            out = sess.run(None, feeds[m])
            if first is None:
                first = [o[0] for o in out]
            diff = max(float(np.abs(o[0] - f).max()) for o, f in zip(out, first, strict=True))
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                sess.run(None, feeds[m])
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            by_rows[m] = {
                "ms": round(ms, 2),
                "weight_GBps": round(weight_bytes / ms / 1e6, 2),
                "GOPps": round(2 * macs_per_row * m / ms / 1e6, 1),
                "row0_max_diff_vs_first_call": diff,
            }
            print(f"{kind:10s} rows {m:3d}: {ms:8.2f} ms  {by_rows[m]}", flush=True)
        ms = [by_rows[m]["ms"] for m in rows]
        report["kinds"][kind] = {
            "by_rows": by_rows,
            "T_last_over_T_first": round(ms[-1] / ms[0], 2),
            "ms_per_added_row": round((ms[-1] - ms[0]) / (rows[-1] - rows[0]), 2) if len(rows) > 1 else None,
        }
        del sess
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "by_rows"} for k, v in report["kinds"].items()}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
