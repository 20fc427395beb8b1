"""The call sequences export validation runs through both ONNX Runtime and PyTorch."""

from __future__ import annotations

import numpy as np


def positions(start: int, n_real: int, length: int) -> np.ndarray:
    pos = np.full((1, length), -1, dtype=np.int64)
    pos[0, :n_real] = np.arange(start, start + n_real)
    return pos


def target_calls(rng, pair: dict, B: int, P: int) -> list[tuple[str, dict]]:
    """A padded prefill chunk, a verify block after it, and a verify after only two of its tokens were
    accepted (exercises padding, cache reuse and rollback)."""
    V = pair["vocab_size"]
    n = P - 2
    ids = rng.integers(0, V, size=(1, P), dtype="int64")
    block = rng.integers(0, V, size=(1, B), dtype="int64")
    return [
        ("prefill(padded)", {"input_ids": ids, "position_ids": positions(0, n, P)}),
        ("verify", {"input_ids": block, "position_ids": positions(n, B, B)}),
        ("verify(2 accepted)", {"input_ids": block[:, ::-1].copy(), "position_ids": positions(n + 2, B, B)}),
    ]


def draft_calls(rng, pair: dict, B: int, P: int) -> list[tuple[str, dict]]:
    H, mask = pair["hidden_size"], pair["mask_token_id"]
    n = P - 2
    block = np.full((1, B), mask, dtype=np.int64)
    block[0, 0] = 1
    first = {
        "input_ids": block,
        "position_ids": positions(n, B, B),
        "context_features": rng.standard_normal((1, P, H)).astype(np.float32),
        "context_position_ids": positions(0, n, P),
    }
    second = {
        "input_ids": block,
        "position_ids": positions(n + min(3, B), B, B),
        "context_features": rng.standard_normal((1, B, H)).astype(np.float32),
        "context_position_ids": positions(n, min(3, B), B),
    }
    return [("context(prefill)", first), ("context(block)", second)]
