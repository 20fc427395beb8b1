"""Build-time checks of compiled ONNX Runtime graphs: they load and run, and positions stay independent.

Causal invariance: a position's outputs must not change when later tokens of the same call change.
Greedy speculative decoding is lossless only if a verify block gives each position what plain
decoding would; a precision scheme that shares numbers across positions (one dynamic activation
scale per call) breaks this, and this check catches it at build time instead of as a "lossless
mismatch" at run time. Call-length invariance: the same positions give bit-equal outputs in one
verify-sized call and in one-token calls, which is what plain decoding and a verify block compare.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cli.errors import DFlashError
from dflash_cli.exporting.options import CONFIDENCE_ATOL, CONFIDENCE_OUTPUT, LOOKUP_BLOCKS

INVARIANCE_RTOL = 1e-5  # relative to the largest magnitude; a same-shape call reruns the same kernels


def smoke(sess, gname: str, info: dict) -> None:
    """One call with zero inputs: proves the graph loads and runs under the session we ship."""
    B, P = info["block_size"], info["prefill_seq_len"]
    feeds = {"input_ids": np.zeros((1, B), np.int64), "position_ids": np.arange(P, P + B, dtype=np.int64)[None]}
    if gname == "draft":
        inp = sess._sess.get_inputs()[2]
        dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
        feeds.update(
            context_features=np.zeros((1, B, inp.shape[-1]), dtype),
            context_position_ids=np.arange(B, dtype=np.int64)[None],
        )
    sess.run(feeds)


def causal_invariance(sess, info: dict, vocab_size: int, seed: int = 0) -> dict:
    """Run one verify-sized call twice, the second with every token from the middle on changed.

    Raises DFlashError naming the output that moved; returns the measured differences.
    """
    B = info["block_size"]
    split = B // 2
    rng = np.random.default_rng(seed)
    first = rng.integers(0, vocab_size, size=(1, B), dtype=np.int64)
    second = first.copy()
    second[0, split:] = (first[0, split:] + 1 + rng.integers(0, vocab_size - 1, size=B - split)) % vocab_size
    pos = np.arange(B, dtype=np.int64)[None]
    outs = []
    for ids in (first, second):
        sess.reset()
        outs.append(sess.run({"input_ids": ids, "position_ids": pos}))
    sess.reset()
    diffs = {}
    for name, a in outs[0].items():
        b = outs[1][name]
        head_a, head_b = a[:, :split], b[:, :split]
        if np.issubdtype(a.dtype, np.integer):
            diff, tol = float(np.mean(head_a != head_b)), 0.0
        else:
            diff = float(np.max(np.abs(head_a.astype(np.float64) - head_b.astype(np.float64))))
            tol = INVARIANCE_RTOL * max(1.0, float(np.abs(head_a).max()))
        diffs[name] = diff
        if diff > tol:
            raise DFlashError(
                f"compiled target is not causal: {name} at positions < {split} moved by {diff:.3g} "
                f"when later tokens of the same call changed",
                hint="this precision mixes positions (e.g. per-call activation scales) and would break lossless "
                "decoding; use compile.ort.precision fp32, int8 or int4 (weight-only)",
            )
    return diffs


def call_length_invariance(sess, info: dict, vocab_size: int, seed: int = 1) -> dict:
    """A verify-sized call and a call as long as the longest verify (the hybrid's lookup steps may verify
    LOOKUP_BLOCKS blocks), then the long call's rows again one call each (what plain decoding runs); the
    largest difference per output (tokens: the fraction that differ).
    Lossless needs 0.0 everywhere.

    For the variable-length (prefix-cache) target. Greedy DFlash equals greedy plain only if a
    position's numbers do not depend on how many rows its call had: a last-bit difference flips
    near-tie tokens (backends/single_row.py: ONNX Runtime's one-row kernels, and when one-token
    calls run as two rows; a kernel may also switch tiling with the number of rows).
    """
    B = info["block_size"]
    room = getattr(sess, "ctx_len", 0) or info.get("ctx_len", 0)
    long = max(B, min(LOOKUP_BLOCKS * B, room - B - 2)) if room else B
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(1, B + long), dtype=np.int64)

    def call(start: int, n: int) -> dict:
        return sess.run({"input_ids": ids[:, start : start + n], "position_ids": np.arange(start, start + n)[None]})

    calls = []
    for n in sorted({B, long}):
        sess.reset()
        call(0, B)  # a prefix in the cache, as after a prompt
        calls.append(call(B, n))
    rows = [call(B + i, 1) for i in range(long)]  # after the long call: each row rewrites its own slot
    sess.reset()
    diffs = {}
    for name in calls[0]:
        b = np.concatenate([r[name] for r in rows], axis=1)
        worst = 0.0
        for out in calls:
            a = out[name]
            part = b[:, : a.shape[1]]
            if np.issubdtype(a.dtype, np.integer):
                worst = max(worst, float(np.mean(a != part)))
            else:
                worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - part.astype(np.float64)))))
        diffs[name] = worst
    return diffs


def graph_weight_bytes(onnx_path: Path) -> int:
    """Bytes of every initializer the graph references (inline and external), counted once per location."""
    import onnx
    from onnx import TensorProto

    model = onnx.load(str(onnx_path), load_external_data=False)
    seen, total = set(), 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            key = (info["location"], info.get("offset", "0"))
            if key not in seen:
                seen.add(key)
                total += int(info.get("length", 0))
        else:
            total += len(t.raw_data)
    return total


REWRITE_RTOL = {"fp32": 1e-4, "fp16": 2e-2}  # relative to the largest magnitude, by export.dtype: fused kernels
# reorder arithmetic and round at other points, which in fp16 moves features by ~1e-3
# int8/int4 weights multiply activations quantised to int8 per token (accuracy_level 4): a rounding
# difference before a MatMul can move an activation by a whole quantisation step, so features move
# by more and near-tie tokens flip (a random-weight Llama-3.1-8B int4: 15% of argmax tokens). A broken
# rewrite moves features by O(1); this bound still catches that. Lossless decoding is checked on the
# compiled graphs themselves (greedy DFlash == greedy plain), not by this comparison.
QUANTIZED_RTOL = 0.1
# w8a8 quantises each activation row on its own (ortcompile/rows_product.py): a last-bit difference before a
# projection moves a code by a step of the whole row's range (level 4: of 32 inputs'), and 36 random layers
# amplify it: the random-weight Qwen3-4B shape's prefix-cache target moved by 0.101 of its features' largest
# magnitude. Still well below a broken rewrite's O(1).
ROWS_RTOL = 0.25


def _fused_check_calls(session, gname: str, info: dict, vocab_size: int, seed: int = 0) -> list[dict]:
    """Target: a prefill chunk ending in padding rows, then a verify block; draft: one call."""
    B, P = info["block_size"], info["prefill_seq_len"]
    rng = np.random.default_rng(seed)
    real = max(1, P - max(1, P // 8))
    prefill_pos = np.full((1, P), -1, np.int64)
    prefill_pos[0, :real] = np.arange(real)
    block_pos = np.arange(real, real + B)[None]
    if gname == "target":
        return [
            {"input_ids": rng.integers(0, vocab_size, size=(1, P), dtype=np.int64), "position_ids": prefill_pos},
            {"input_ids": rng.integers(0, vocab_size, size=(1, B), dtype=np.int64), "position_ids": block_pos},
        ]
    inp = session._sess.get_inputs()[2]
    dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
    return [
        {
            "input_ids": rng.integers(0, vocab_size, size=(1, B), dtype=np.int64),
            "position_ids": block_pos,
            "context_features": rng.standard_normal((1, P, inp.shape[-1])).astype(dtype),
            "context_position_ids": prefill_pos,
        }
    ]


def reference_outputs(unfused, gname: str, info: dict, vocab_size: int) -> list[tuple[dict, dict]]:
    """(feeds, outputs) of the unfused graph on the check's calls; the session can be freed afterwards,
    so the build never holds both graphs at once."""
    unfused.reset()
    out = [(feeds, unfused.run(feeds)) for feeds in _fused_check_calls(unfused, gname, info, vocab_size)]
    unfused.reset()
    return out


def matches_reference(
    fused,
    reference: list[tuple[dict, dict]],
    label: str,
    dtype: str = "fp32",
    quantized: bool = False,
    rows: bool = False,
) -> dict[str, float]:
    """A rewritten graph (ortcompile.fuse, or a prefix-cache twin) on the calls `reference_outputs` recorded
    from the exported graph, on real (not padding) rows: float outputs within REWRITE_RTOL[dtype]; token
    outputs equal in fp32 (in fp16 a near tie may flip with the rounding, so only the features judge; so
    too with `quantized` weights, judged within QUANTIZED_RTOL, or ROWS_RTOL with `rows`: w8a8's activations).
    Raises DFlashError naming the output;
    returns the largest relative difference per output (for tokens: the fraction that differ).
    """
    rtol = ROWS_RTOL if rows else QUANTIZED_RTOL if quantized else REWRITE_RTOL.get(dtype, REWRITE_RTOL["fp16"])
    worst: dict[str, float] = {}
    fused.reset()
    for feeds, ref in reference:
        got = fused.run(feeds)
        real = feeds["position_ids"][0] >= 0  # padding rows' outputs are never read (and may differ)
        for name, want in ref.items():
            have = got[name]
            if want.ndim >= 2 and want.shape[1] == real.size:
                have, want = have[:, real], want[:, real]
            if np.issubdtype(want.dtype, np.integer):
                diff = float(np.mean(have != want))
                bad = diff > 0 and dtype == "fp32" and not quantized
            elif (
                name == CONFIDENCE_OUTPUT
            ):  # a probability: an absolute bound (exporting/options.py), as tokens none quantized
                diff = float(np.max(np.abs(have.astype(np.float64) - want.astype(np.float64))))
                bad = diff > CONFIDENCE_ATOL.get(dtype, CONFIDENCE_ATOL["fp16"]) and not quantized
            else:
                scale = max(1.0, float(np.abs(want).max()))
                diff = float(np.max(np.abs(have.astype(np.float64) - want.astype(np.float64)))) / scale
                bad = not diff <= rtol
            worst[name] = max(worst.get(name, 0.0), diff)
            if bad:
                raise DFlashError(
                    f"the {label} graph differs from the exported one: {name} moved by {diff:.3g}",
                    hint="a dflash bug in the ONNX Runtime graphs; build with `--set compile.ort.fuse=false` "
                    "(fused) or run with `--set compile.ort.prefix_cache=false` (prefix cache) meanwhile",
                )
    fused.reset()
    return worst


def projection_macs(onnx_path: Path) -> int:
    """Multiply-adds one row (token) costs in the graph's weight products: K x N of every MatMul with a constant
    weight, MatMulNBits and RowsMatMul (ortcompile/quantize_forms.py). Experts (QMoE) are not counted."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    transposes = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Transpose"}
    total = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            total += attrs.get("K", 0) * attrs.get("N", 0)
        elif node.op_type in ("MatMul", "RowsMatMul") and len(node.input) > 1:
            weight = inits.get(node.input[1]) or inits.get(transposes.get(node.input[1], ""))
            if weight is not None and len(weight.dims) == 2:
                total += weight.dims[0] * weight.dims[1]
    return total
