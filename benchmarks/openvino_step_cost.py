"""OpenVINO against ONNX Runtime, per call, on the same exported graphs: T(B) for B = 1..16 and the draft call.

    PEERS_OPENVINO=1 bash benchmarks/peers_setup.sh   # OpenVINO + NNCF in the benchmark venv, never package deps
    python benchmarks/openvino_step_cost.py --export EXPORT_DIR --compile COMPILE_DIR [--ov-int4 GRAPH.onnx]
        [--filled 256] [--rounds 9] [--out F.json]

EXPORT_DIR is an export artifact (its `*_prefix.onnx` graphs are plain ONNX: OpenVINO reads them as they
are); COMPILE_DIR the ONNX Runtime compile artifact of the same pair, opened as `dflash run` opens it
(prefix-cache sessions, in-place GroupQueryAttention). Variants, every round timing each in turn so machine
noise hits all alike, one-token to 16-token target calls after FILLED cached tokens, and the draft call:
* `ort`: the compile artifact (fp32, or int4 MatMulNBits, whatever it was built at);
* `ov-f32`, `ov-bf16`: OpenVINO on the export graph, inference precision hint f32 / bf16;
* `ov-nncf-int4`: the export graph with OpenVINO's own weight compression (NNCF, int4 symmetric, group 128,
  every MatMul), precision hint f32; `ov-mnb-int4`: OpenVINO reading our MatMulNBits graph (`--ov-int4`,
  an unfused ORT int4 build's target_prefix.onnx);
Also: whether each OpenVINO variant's rows of a 16-token call equal the same rows called one at a time
(lossless decoding needs them bit-equal; `dflash` checks this for ONNX Runtime at build time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LENGTHS = (1, 2, 4, 8, 16)


def ov_model(path: Path, int4: bool):
    import openvino as ov

    model = ov.Core().read_model(str(path))
    if int4:
        import nncf
        from openvino import passes

        pm = passes.Manager()  # fold the weights' Transpose nodes so NNCF sees MatMuls of constants
        pm.register_pass(passes.ConstantFolding())
        pm.run_passes(model)
        model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=128, ratio=1.0)
    return model


class OvCall:
    """An OpenVINO compiled model fed like a prefix-cache graph: past_* of FILLED zero rows."""

    def __init__(self, model, hint: str, threads: int) -> None:
        import openvino as ov

        props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": hint}
        self.compiled = ov.Core().compile_model(model, "CPU", props)
        self.request = self.compiled.create_infer_request()
        self.past = [i.get_any_name() for i in self.compiled.inputs if i.get_any_name().startswith("past_")]
        self.shape = (
            tuple(
                self.compiled.inputs[[i.get_any_name() for i in self.compiled.inputs].index(self.past[0])]
                .get_partial_shape()[2:]
                .to_shape()
            )
            if self.past
            else ()
        )

    def __call__(self, feeds: dict, filled: int) -> dict:
        feeds = dict(feeds)
        for name in self.past:
            feeds[name] = np.zeros((1, filled, *self.shape), np.float32)
        result = self.request.infer(feeds)
        return {k.get_any_name(): v for k, v in result.items()}


def target_feeds(rng, vocab: int, filled: int, n: int) -> dict:
    return {
        "input_ids": rng.integers(0, vocab, (1, n), dtype=np.int64),
        "position_ids": np.arange(filled, filled + n, dtype=np.int64)[None],
    }


def draft_feeds(rng, info: dict, filled: int) -> dict:
    block, hidden = info["block_size"], info["draft_feature_size"]
    return {
        "input_ids": rng.integers(0, info["vocab_size"], (1, block), dtype=np.int64),
        "position_ids": np.arange(filled + 1, filled + 1 + block, dtype=np.int64)[None],
        "context_features": rng.standard_normal((1, 1, hidden)).astype(np.float32),
        "context_position_ids": np.array([[filled]], dtype=np.int64),
    }


def row_invariance(call, vocab: int, filled: int) -> bool:
    """Rows of one 16-token call against the same tokens one call each (cache contents aside: all zero)."""
    rng = np.random.default_rng(7)
    block = target_feeds(rng, vocab, filled, 16)
    whole = call(block, filled)["context_features"]
    for i in range(16):
        one = {"input_ids": block["input_ids"][:, i : i + 1], "position_ids": block["position_ids"][:, i : i + 1]}
        row = call(one, filled + i)["context_features"]
        if not np.array_equal(row[0, 0], whole[0, i]):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--compile", type=Path, required=True)
    ap.add_argument("--ov-int4", type=Path, help="an unfused ORT int4 build's target_prefix.onnx (MatMulNBits)")
    ap.add_argument("--filled", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-nncf", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import onnx

    from dflash_cli.backends.ort import OrtSettings
    from dflash_cli.backends.ort_prefix import open_prefix_session

    info = json.loads((args.export / "export.json").read_text()) | json.loads((args.export / "pair.json").read_text())
    draft_graph = onnx.load(str(args.export / "draft_prefix.onnx"), load_external_data=False)
    features = next(i for i in draft_graph.graph.input if i.name == "context_features")
    info["draft_feature_size"] = features.type.tensor_type.shape.dim[2].dim_value
    vocab, ctx = info["vocab_size"], info["ctx_len"]
    ort_target = open_prefix_session(args.compile / "target_prefix.onnx", "target", ctx, OrtSettings())
    ort_draft = open_prefix_session(args.compile / "draft_prefix.onnx", "draft", ctx, OrtSettings())

    def ort_call(sess):  # the session's cache holds FILLED slots below the call (whatever they hold: same cost)
        return lambda feeds, filled: sess.run(feeds)

    variants = {"ort": (ort_call(ort_target), ort_call(ort_draft))}
    tp, dp = args.export / "target_prefix.onnx", args.export / "draft_prefix.onnx"
    for hint in ("f32", "bf16"):
        started = time.perf_counter()
        variants[f"ov-{hint}"] = (
            OvCall(ov_model(tp, False), hint, args.threads),
            OvCall(ov_model(dp, False), hint, args.threads),
        )
        print(f"ov-{hint}: compiled in {time.perf_counter() - started:.1f} s", flush=True)
    if not args.no_nncf:
        variants["ov-nncf-int4"] = (
            OvCall(ov_model(tp, True), "f32", args.threads),
            OvCall(ov_model(dp, True), "f32", args.threads),
        )
    if args.ov_int4:
        variants["ov-mnb-int4"] = (OvCall(ov_model(args.ov_int4, False), "f32", args.threads), None)

    rng = np.random.default_rng(0)
    times = {name: {str(n): [] for n in LENGTHS} | {"draft": []} for name in variants}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in LENGTHS:
            feeds = target_feeds(rng, vocab, args.filled, n)
            for name, (target, _) in variants.items():
                t = time.perf_counter()
                target(feeds, args.filled)
                if r:
                    times[name][str(n)].append(time.perf_counter() - t)
        feeds = draft_feeds(rng, info, args.filled)
        for name, (_, draft) in variants.items():
            if draft is None:
                continue
            t = time.perf_counter()
            draft(feeds, args.filled)
            if r:
                times[name]["draft"].append(time.perf_counter() - t)
        print(f"round {r}/{args.rounds}", flush=True)

    report = {"export": str(args.export), "compile": str(args.compile), "filled": args.filled, "variants": {}}
    for name, kinds in times.items():
        med = {k: 1000 * statistics.median(v) for k, v in kinds.items() if v}
        row = {"ms": {k: round(v, 2) for k, v in med.items()}}
        row["verify_16_over_1"] = round(med["16"] / med["1"], 2)
        if "draft" in med:
            row["draft_over_1"] = round(med["draft"] / med["1"], 2)
            row["break_even_tau_16"] = round((med["draft"] + med["16"]) / med["1"], 2)
        if name.startswith("ov"):
            row["rows_equal_one_row_calls"] = row_invariance(variants[name][0], vocab, args.filled)
        report["variants"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
