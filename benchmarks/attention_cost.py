"""What ONNX Runtime's GroupQueryAttention costs a decode step, against the cache length filled.

    python benchmarks/attention_cost.py [--heads 16 --kv-heads 8 --head-dim 128 --layers 28] \
        [--slots 1025,4097] [--past 230,900] [--rows 2] [--out F.txt]

One graph of `--layers` GroupQueryAttention nodes as the compile writes them (rotary inside, the cache
bound in place as `dflash run` binds it), random inputs, `--rows` query rows per call (2: a one-token call
attends as two rows). Prints the median ms per call for every cache size (`--slots`, ctx_len + 1) and
filled length (`--past`). The defaults are the Qwen3-0.6B shape.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def _model(heads: int, kv: int, dim: int, layers: int, slots: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.random((slots, dim // 2), dtype=np.float32), n) for n in ("cos", "sin")]
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("q", f, [1, "rows", heads * dim]),
        helper.make_tensor_value_info("k", f, [1, "rows", kv * dim]),
        helper.make_tensor_value_info("v", f, [1, "rows", kv * dim]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
    ]
    nodes, outputs = [], []
    for i in range(layers):
        inputs += [helper.make_tensor_value_info(f"past_{c}{i}", f, [1, kv, slots, dim]) for c in "kv"]
        names = [f"out{i}", f"present_k{i}", f"present_v{i}"]
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                ["q", "k", "v", f"past_k{i}", f"past_v{i}", "seqlens_k", "total_len", "cos", "sin"],
                names,
                domain="com.microsoft",
                do_rotary=1,
                kv_num_heads=kv,
                num_heads=heads,
                scale=dim**-0.5,
            )
        )
        outputs += [helper.make_tensor_value_info(n, f, None) for n in names]
    graph = helper.make_graph(nodes, "attention", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--slots", default="1025,4097")
    ap.add_argument("--past", default="230,900")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import onnxruntime as ort

    rng = np.random.default_rng(1)
    lines = [
        f"GroupQueryAttention x{args.layers}, {args.heads}/{args.kv_heads} heads of {args.head_dim}, {args.rows} rows"
    ]
    for slots in (int(s) for s in args.slots.split(",")):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        sess = ort.InferenceSession(_model(args.heads, args.kv_heads, args.head_dim, args.layers, slots), opts)
        binding = sess.io_binding()
        caches = []  # keep the bound buffers alive
        for i in range(args.layers):
            for c in "kv":
                value = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, args.kv_heads, slots, args.head_dim), np.float32))
                caches.append(value)
                binding.bind_ortvalue_input(f"past_{c}{i}", value)
                binding.bind_ortvalue_output(f"present_{c}{i}", value)
        for past in (int(p) for p in args.past.split(",")):
            for name, width in (("q", args.heads), ("k", args.kv_heads), ("v", args.kv_heads)):
                binding.bind_cpu_input(
                    name, rng.standard_normal((1, args.rows, width * args.head_dim), dtype=np.float32)
                )
            binding.bind_cpu_input("seqlens_k", np.array([past + args.rows - 1], np.int32))
            binding.bind_cpu_input("total_len", np.array(past + args.rows, np.int32))
            for i in range(args.layers):
                binding.bind_output(f"out{i}", "cpu")
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                sess.run_with_iobinding(binding)
                times.append(time.perf_counter() - t)
            lines.append(f"  cache of {slots} slots, {past} filled: {statistics.median(times) * 1e3:7.2f} ms a call")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
