"""A compiled QAIC continuous-batching program (a "_cb" graph) emulated by ONNX Runtime, for the tests that have
no card: QaicSlots (qaic/slots.py) drives it as it drives the card's program."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort


class EmulatedProgram:
    """A compiled QAIC program as QaicSession presents one, run by ONNX Runtime: the retained caches stay inside
    (as on the card), and only the specializations' shapes are taken (batch 1, or all `full` slots)."""

    def __init__(self, path: Path, full: int, seq_lens: list[int]) -> None:
        self.name = path.stem.removesuffix("_cb")
        self.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        ins = self.sess.get_inputs()
        self.input_names = [i.name for i in ins if not i.name.startswith("past_")]
        self.cache = {i.name: np.zeros(i.shape, np.float32) for i in ins if i.name.startswith("past_")}
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.full, self.seq_lens, self.batches = full, seq_lens, []

    def serves(self, shapes) -> bool:
        return shapes["input_ids"][0] in (1, self.full) and shapes["input_ids"][1] in self.seq_lens

    def run(self, feeds):
        assert self.serves({"input_ids": np.shape(feeds["input_ids"])}), np.shape(feeds["input_ids"])
        self.batches.append(len(feeds["batch_index"]))
        res = dict(zip(self.outputs, self.sess.run(None, {**feeds, **self.cache})))
        self.cache = {n: res.pop(n + "_RetainedState") for n in self.cache}
        return res
