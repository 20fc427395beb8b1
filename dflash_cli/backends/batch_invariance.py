"""Batch invariance: a sequence's outputs must not change when other sequences share its call.

Like causal invariance, this is what keeps served output identical to a solo run: a last-bit difference
in a feature (a kernel that tiles differently for more rows, a reduction that changes order with the
batch) can flip a near-tie token. The check runs three sequences of different lengths through the
batched target (backends/ort_batched.py), each alone and then all together, over calls of the shapes
serving makes: prefill chunks, verify blocks, one-token steps, and calls of unequal lengths side by side.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def batch_invariance(onnx_path: Path, info: dict, vocab_size: int, settings, pad_single_rows: bool, one=None) -> dict:
    """{"sequences": 3, "max_diff": {output: worst}, "equal": bool} (tokens: the fraction that differ).
    `one`: an open session of the graph for the calls of one sequence (else one more is opened)."""
    from dflash_cli.backends.ort_batched import BatchedTarget

    # The check's sequences reach about 4 blocks: caches of 8 blocks, not ctx_len (each of the 3 slots' K/V
    # buffers is 1.2 GB at the 4B shape's 4096 positions). The attention reads only a sequence's filled positions.
    ctx = min(info["ctx_len"], 8 * info["block_size"])
    target = BatchedTarget(onnx_path, ctx, 3, settings, pad_single_rows=pad_single_rows, one=one)
    return check_target(target, info["block_size"], vocab_size)


def check_target(target, B: int, vocab_size: int) -> dict:
    """The check on an open BatchedTarget or QaicSlots (`dflash serve` checks the one it serves with where the
    build could not): 3 sequences, or 2 on a target of 2 slots. It writes their caches: run it before any request."""
    ctx, n = target.ctx_len, min(3, target.slots)
    rng = np.random.default_rng(3)
    prompts = [min(k, ctx // 4) for k in (B + 3, 2 * B, 5)]
    # Each step: every sequence's call length (prefill, verify blocks, one-token steps, a mixture).
    steps = [s[:n] for s in (prompts, [B, B, B], [1, 1, 1], [B, 1, B // 2 or 1], [3, B, 1])]
    if not target.variable_length:  # a QAIC program: only the lengths it was compiled for
        steps = [[length] * n for length in (target.prefill_len, B, 1, B)]
    tokens = [rng.integers(0, vocab_size, size=sum(s[j] for s in steps), dtype=np.int64) for j in range(n)]

    def calls(j: int):
        pos = 0
        for s in steps:
            n = s[j]
            yield {"input_ids": tokens[j][None, pos : pos + n], "position_ids": np.arange(pos, pos + n)[None]}
            pos += n

    alone = [[target.run([j], [feeds])[0] for feeds in calls(j)] for j in range(n)]
    together: list[list[dict]] = [[] for _ in range(n)]
    for feeds in zip(*(calls(j) for j in range(n))):
        for j, out in enumerate(target.run(list(range(n)), list(feeds))):
            together[j].append(out)
    worst: dict[str, float] = {}
    for j in range(n):
        for a, b in zip(alone[j], together[j]):
            for name, va in a.items():
                vb = b[name]
                if np.issubdtype(va.dtype, np.integer):
                    d = float(np.mean(va != vb))
                else:
                    d = float(np.max(np.abs(va.astype(np.float64) - vb.astype(np.float64))))
                worst[name] = max(worst.get(name, 0.0), d)
    return {"sequences": n, "max_diff": worst, "equal": all(v == 0.0 for v in worst.values())}
