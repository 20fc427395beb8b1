"""Chunked prefill and block calls of the target session (padding with position -1)."""

from __future__ import annotations

import time

import numpy as np

from dflash_cli.backends.base import Session


class TimedSession:
    """Wraps a session to count calls and the seconds spent inside them."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.calls = 0
        self.seconds = 0.0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = time.perf_counter()
        out = self.session.run(feeds)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out

    def reset_counters(self) -> None:
        self.calls, self.seconds = 0, 0.0


def padded(ids: list[int], start: int, length: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[1, length] ids and positions for tokens at start..; padding gets position -1."""
    n = len(ids)
    arr = np.full((1, length), pad_id, dtype=np.int64)
    pos = np.full((1, length), -1, dtype=np.int64)
    arr[0, :n] = ids
    pos[0, :n] = np.arange(start, start + n)
    return arr, pos


def prefill(target: TimedSession, prompt: list[int], chunk: int) -> dict[str, np.ndarray]:
    """Run the prompt in fixed-size chunks; returns the outputs of every real position, concatenated."""
    outs: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(prompt), chunk):
        part = prompt[start : start + chunk]
        ids, pos = padded(part, start, chunk)
        res = target.run({"input_ids": ids, "position_ids": pos})
        for k, v in res.items():
            outs.setdefault(k, []).append(v[0, : len(part)])
    return {k: np.concatenate(v, axis=0) for k, v in outs.items()}
