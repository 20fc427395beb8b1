"""Rollback designs for Gated DeltaNet states, measured on one layer of a real shape in ONNX Runtime.

    python benchmarks/gated_delta_rollback.py [--shape qwen3.5-9b] [--calls 30] [--threads 2] [--out F.json]

Three one-layer graphs (random weights, fp32, the dynamo exporter the build uses), each timed at call
lengths 1 (plain decode), B (a verify block) and the prefill chunk, interleaved so machine noise hits all
alike; medians per call and the state bytes each keeps per call:
* `no-rollback`: the layer with its final states only (what plain decoding needs): the floor;
* `per-position`: every position's conv and recurrent state out of a verify (what vLLM / SGLang keep):
  rollback picks index n-1;
* `pending-rows` (ours, modeling/delta_rollback.py): the states at the call's start plus each row's
  delta-rule terms; the next call folds in the accepted rows. Also timed: the call after a verify
  of which none / all rows were accepted (what a rejection costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # the Gated DeltaNet layer of the model cards
    "qwen3.5-9b": dict(hidden_size=4096, linear_num_key_heads=16, linear_num_value_heads=32),
    "qwen3.5-4b": dict(hidden_size=2560, linear_num_key_heads=16, linear_num_value_heads=32),
}


def _config(shape: str):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        num_hidden_layers=1, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        **SHAPES[shape],
    )  # fmt: skip


class _Final(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, conv, rec):
        return self.layer.forward_chunked(x, conv, rec)


class _PerPosition(_Final):
    def forward(self, x, conv, rec):
        return self.layer(x, conv, rec)


class _Pending(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, positions, conv, rec, rows, row_positions):
        from dflash_cli.modeling.delta_rollback import row_plan

        valid, fresh, commit, fold, pick, _ = row_plan(positions, row_positions, None)
        return self.layer.step(x, valid, fresh, commit, fold, pick, conv, rec, rows)


def _export(module, args, names, path: Path, dynamic) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), dynamo=True, opset_version=18, input_names=names,
                          dynamic_shapes=dynamic, verbose=False)  # fmt: skip


def _session(path: Path, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(SHAPES))
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=64)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from dflash_cli.modeling.delta_rollback import RollbackDeltaLayer
    from dflash_cli.modeling.gated_delta import squarings_for

    torch.manual_seed(0)
    cfg = _config(args.shape)
    layer = RollbackDeltaLayer(cfg, squarings_for(args.prefill)).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        layer.A_log.fill_(0.5)
        layer.dt_bias.fill_(1.0)
        layer.norm.weight.fill_(1.0)
    B, H = args.block, cfg.hidden_size
    conv0, rec0 = layer.zero_states(1)
    rows0 = layer.empty_rows(1, B)
    tmp = Path(tempfile.mkdtemp())
    pos0 = torch.arange(100, 100 + B)[None]
    sessions = {}
    for t in (1, B, args.prefill):  # one graph per call length: forward_chunked's chunk loop is fixed at trace
        x = torch.randn(1, t, H)
        pos = torch.arange(100, 100 + t)[None]
        layer.chunk_size = t  # the floor computes one chunk of exactly the call
        for kind, module, inputs, names in (
            ("final", _Final(layer), (x, conv0, rec0), ["x", "conv", "rec"]),
            ("per_position", _PerPosition(layer), (x, conv0, rec0), ["x", "conv", "rec"]),
            (
                "pending",
                _Pending(layer),
                (x, pos, conv0, rec0, rows0, pos0),
                ["x", "positions", "conv", "rec", "rows", "row_positions"],
            ),
        ):
            path = tmp / f"{kind}_{t}.onnx"
            _export(module, inputs, names, path, None)
            sessions[(kind, t)] = _session(path, args.threads)
    rng = np.random.default_rng(0)
    conv = rng.standard_normal(conv0.shape).astype(np.float32)
    rec = (0.1 * rng.standard_normal(rec0.shape)).astype(np.float32)
    rows = (0.1 * rng.standard_normal((1, B, layer.row_width))).astype(np.float32)
    row_pos = np.arange(100 - B, 100)[None].astype(np.int64)

    def feeds(kind: str, t: int, accepted: int = B) -> dict:
        xs = rng.standard_normal((1, t, H)).astype(np.float32)
        if kind != "pending":
            return {"x": xs, "conv": conv, "rec": rec}
        # the pending rows are the previous verify's, at positions 100-B..99; the call starts after the accepted ones
        start = 100 - B + accepted
        return {"x": xs, "positions": np.arange(start, start + t)[None].astype(np.int64), "conv": conv,
                "rec": rec, "rows": rows, "row_positions": row_pos}  # fmt: skip

    cases = [(k, t, B) for t in (1, B, args.prefill) for k in ("final", "per_position", "pending")]
    cases += [("pending", 1, 1), ("pending", B, 1)]  # after a verify of which only its first token was accepted
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for _ in range(3):  # warm-up
        for kind, t, acc in cases:
            sessions[(kind, t)].run(None, feeds(kind, t, acc))
    for _ in range(args.calls):
        for case in cases:
            kind, t, acc = case
            f = feeds(kind, t, acc)
            t0 = time.perf_counter()
            sessions[(kind, t)].run(None, f)
            times[case].append(time.perf_counter() - t0)
    state_bytes = {}
    for kind in ("final", "per_position", "pending"):
        out = sessions[(kind, B)].run(None, feeds(kind, B))
        state_bytes[kind] = int(sum(o.nbytes for o in out[1:]))
    rows_out = []
    for case, ts in times.items():
        kind, t, acc = case
        rows_out.append(
            {"design": kind, "call_len": t, "accepted_before": acc, "median_ms": 1e3 * statistics.median(ts)}
        )
    report = {
        "shape": args.shape,
        "threads": args.threads,
        "calls": args.calls,
        "block": B,
        "state_bytes_per_verify_call_per_layer": state_bytes,
        "timings": rows_out,
    }
    print(f"{'design':14s} {'len':>4s} {'acc':>4s} {'median ms':>10s}")
    for r in rows_out:
        print(f"{r['design']:14s} {r['call_len']:4d} {r['accepted_before']:4d} {r['median_ms']:10.2f}")
    print("state bytes kept per verify call and layer:", {k: f"{v / 2**20:.2f} MiB" for k, v in state_bytes.items()})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
