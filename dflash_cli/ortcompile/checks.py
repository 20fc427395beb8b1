"""Build-time checks of compiled ONNX Runtime graphs: they load and run, and positions stay independent.

Causal invariance: a position's outputs must not change when later tokens of the same call change.
Greedy speculative decoding is lossless only if a verify block gives each position what plain
decoding would; a precision scheme that shares numbers across positions (one dynamic activation
scale per call) breaks this, and this check catches it at build time instead of as a "lossless
mismatch" at run time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cli.errors import DFlashError

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
