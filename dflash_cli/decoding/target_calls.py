"""Chunked prefill and block calls of the target session (padding with position -1)."""

from __future__ import annotations

import time

import numpy as np

from dflash_cli.backends.base import Session
from dflash_cli.errors import GenerationError


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


def chunk_bounds(n: int, chunk: int, spans: list[tuple[int, int]], variable: bool) -> list[tuple[int, int]]:
    """[start, end) of each prefill call: `chunk` tokens, except that no call splits a span (an image whose
    tokens attend to each other, Gemma 4): a call ends before the span instead, and a span longer than
    `chunk` gets a call of its own, which only a variable-length session can take."""
    bounds, start = [], 0
    while start < n:
        end = min(start + chunk, n)
        for a, b in spans:
            if a < end < b:  # the call would split this span
                if a > start:
                    end = a
                elif variable:
                    end = b
                else:
                    raise GenerationError(
                        f"an image of {b - a} tokens does not fit one prefill call of {chunk} tokens",
                        hint="use the ONNX Runtime prefix-cache graphs (the default), or a larger "
                        "export.prefill_seq_len, or a smaller image",
                    )
        bounds.append((start, end))
        start = end
    return bounds


def prefill(target: TimedSession, prompt: list[int], chunk: int) -> dict[str, np.ndarray]:
    """Run the prompt in chunks (chunk_bounds); returns the outputs of every real position, concatenated."""
    outs: dict[str, list[np.ndarray]] = {}
    feeder = getattr(target.session, "vision", None)
    spans = feeder.prompt.image_spans() if feeder is not None and feeder.prompt is not None else []
    variable = target.session.variable_length
    for start, end in chunk_bounds(len(prompt), chunk, spans, variable):
        part = prompt[start:end]
        # A fixed-shape graph takes whole chunks; a variable-length one only the real rows (padding rows cost
        # as much as real ones: a 10-token prompt padded to a 128-token chunk took 13x the work).
        ids, pos = padded(part, start, len(part) if variable else max(chunk, len(part)))
        res = target.run({"input_ids": ids, "position_ids": pos})
        for k, v in res.items():
            outs.setdefault(k, []).append(v[0, : len(part)])
    return {k: np.concatenate(v, axis=0) for k, v in outs.items()}
