"""Progress of writing a graph's weights: a line at most every few seconds."""

from __future__ import annotations

import time
from collections.abc import Callable


class Throttled:
    """Progress lines at most every few seconds: tensor k of n and bytes written."""

    def __init__(self, progress: Callable[[str], None], gname: str, every_s: float = 3.0) -> None:
        self.progress, self.gname, self.every_s = progress, gname, every_s
        self.last = 0.0

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        now = time.monotonic()
        if done == total or now - self.last >= self.every_s:
            self.last = now
            self.progress(f"{self.gname}.onnx: tensor {done}/{total}, {nbytes / 1e9:.2f} GB written")
