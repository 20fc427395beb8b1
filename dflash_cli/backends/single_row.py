"""A one-token call of the target can run as two rows, so every position sees the numbers a block would.

ONNX Runtime's CPU kernels take their own path for a product with a single row (MLAS's M=1 kernels:
fp32 MatMul, GroupQueryAttention's score and value products, MatMulNBits at some block sizes), and
its sums round differently from the same row inside a larger call. Plain decoding (one row per call)
and a verify block (many rows) then disagree in the last bits for the same position, and once
activations are quantised to int8 a last-bit difference can move a feature by a whole quantisation
step: on a random-weight Llama-3.1-8B int4 build, greedy DFlash left greedy plain decoding at token
6 of 32. Two rows take the path a block takes (rows bit-equal to a 16-row call, measured).

The attention rewrite pads q/k/v to two rows inside the graph (ortcompile/gqa.py), which costs
nothing measurable. Padding the whole call (here) also makes the weights' products take the block
path, at a price: +0.6% per fp32 decode step, +13% per int4 one on the 0.6B-shaped target (one-row
MatMulNBits is cheaper). So the build tries one-token calls as they are first, then padded
(compile.json `prefix_one_token_calls`), and the engine pads only when the build needed it. The second
row is the same token at the next position: the next call overwrites its cache slot before any
query reads it, and its outputs are dropped.
"""

from __future__ import annotations

import numpy as np

POSITIONS = "position_ids"


def pad_single_row(feeds: dict[str, np.ndarray], ctx_len: int) -> tuple[dict[str, np.ndarray], bool]:
    """(feeds with a second row, True) for a one-row call that has room for it; else (feeds, False)."""
    positions = np.asarray(feeds[POSITIONS])
    if positions.shape[1] != 1 or positions[0, 0] < 0 or positions[0, 0] + 2 > ctx_len:
        return feeds, False  # the last cache slot has no room: that one call runs as a single row
    padded = {}
    for name, arr in feeds.items():
        arr = np.asarray(arr)
        padded[name] = np.concatenate([arr, arr + 1 if name == POSITIONS else arr], axis=1)
    return padded, True


def first_row(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The real row's outputs of a padded call (every output is [1, rows, ...])."""
    return {name: v[:, :1] if v.ndim >= 2 and v.shape[1] == 2 else v for name, v in outputs.items()}
