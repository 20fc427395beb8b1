"""What a plain decode step's weight products cost on their own: the floor under dflash's ONNX Runtime step.

    python benchmarks/kernel_floor.py TARGET_DIR [--block 32] [--reps 40] [--rows 1] [--out F.txt]

From the target's config.json it builds, with random weights, one ONNX graph per projection shape of a
decode step as the int4 compile makes it (q/k/v stacked, o, gate/up stacked, down: one node per layer,
and the lm_head), each `MatMulNBits` (accuracy level 4) reading `--rows` activation rows (2: a one-token
call as `dflash run` makes it where the build found one-row products round differently), and the same
shapes as fp32 `MatMul`. It times each graph on ONNX Runtime's shared spinning pool (as `dflash run`
decodes plain) and prints ms per step and the weight bytes streamed per second, then this machine's
read bandwidth on two threads (torch.sum over 2 GiB) for scale. Nothing else of the step is in these
graphs (norms, attention, the executor), so their sum is a floor no graph rewrite goes under.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def _model(K: int, N: int, copies: int, int4: bool, block: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    for r in range(copies):
        if int4:
            blocks = K // block
            packed = rng.integers(0, 256, (N, blocks, block // 2), dtype=np.uint8)
            scales = (rng.random(N * blocks, dtype=np.float32) + 0.5) * 0.01
            inits += [numpy_helper.from_array(packed, f"w{r}"), numpy_helper.from_array(scales, f"s{r}")]
            nodes.append(
                helper.make_node(
                    "MatMulNBits",
                    ["x", f"w{r}", f"s{r}"],
                    [f"y{r}"],
                    domain="com.microsoft",
                    K=K,
                    N=N,
                    bits=4,
                    block_size=block,
                    accuracy_level=4,
                )
            )
        else:
            inits.append(numpy_helper.from_array(rng.random((K, N), dtype=np.float32) - 0.5, f"w{r}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{r}"], [f"y{r}"]))
    graph = helper.make_graph(
        nodes,
        "products",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "rows", K])],
        [helper.make_tensor_value_info(f"y{r}", TensorProto.FLOAT, None) for r in range(copies)],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _time(model: bytes, K: int, reps: int, rows: int = 1) -> float:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.use_per_session_threads = False
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1")
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).random((1, rows, K), dtype=np.float32)
    for _ in range(3):
        sess.run(None, {"x": x})
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _read_bandwidth() -> float:
    import torch

    torch.set_num_threads(2)
    a = torch.rand(512 << 20)
    a.sum()
    best = min(_elapsed(a.sum) for _ in range(5))
    return a.numel() * 4 / best


def _elapsed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path, help="a Hugging Face target checkpoint directory (its config.json)")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=1, help="rows per call (dflash pads one-token calls to 2 where needed)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from dflash_cli.host.ort_threads import use_shared_thread_pool

    use_shared_thread_pool(0)
    cfg = json.loads((args.target / "config.json").read_text())
    H, F, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or H // heads
    shapes = {
        "q/k/v": (H, (heads + 2 * kv) * hd, L),
        "o": (heads * hd, H, L),
        "gate/up": (H, 2 * F, L),
        "down": (F, H, L),
        "lm_head": (H, V, 1),
    }
    lines = [f"{args.target} ({L} layers, hidden {H}); products of {args.rows} row(s), ms per decode step"]
    for label, int4 in ((f"int4 MatMulNBits block {args.block}, accuracy 4", True), ("fp32 MatMul", False)):
        total_s, total_bytes = 0.0, 0
        for name, (K, N, copies) in shapes.items():
            seconds = _time(_model(K, N, copies, int4, args.block), K, args.reps, args.rows)
            nbytes = copies * K * N * ((0.5 + 4 / args.block) if int4 else 4)
            total_s, total_bytes = total_s + seconds, total_bytes + nbytes
            rate = nbytes / seconds / 1e9
            lines.append(f"  {label}: {name:8s} x{copies:<3d} {seconds * 1e3:8.3f} ms  {rate:5.1f} GB/s")
        lines.append(f"  {label}: all {total_s * 1e3:.2f} ms per step, {total_bytes / total_s / 1e9:.1f} GB/s")
    lines.append(f"read bandwidth, torch.sum over 2 GiB on 2 threads: {_read_bandwidth() / 1e9:.1f} GB/s")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
