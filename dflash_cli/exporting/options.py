"""What an export is asked for: the pair's graph shapes and one options object (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Validation = Literal["off", "full", "reduced"]  # reduced: a few layers and vocabulary rows (validate.py)


@dataclass(frozen=True)
class PairShape:
    block: int
    prefill: int
    ctx_len: int
    hidden: int


@dataclass(frozen=True)
class ExportOptions:
    dtype: Literal["fp32", "fp16"] = "fp32"  # weights and compute of the graphs
    logits: bool = False  # the graphs also output full logits (not only argmax tokens)
    opset: int = 18
    prefix_graphs: bool = True  # also target_prefix.onnx / draft_prefix.onnx, the prefix-cache form ORT runs
    validation: Validation = "full"

    @classmethod
    def of(cls, export: Any, validation: Validation) -> ExportOptions:
        """From a recipe's `export` section; `validation` as the stage decided it for the pair's size."""
        return cls(dtype=export.dtype, logits=export.logits, opset=export.opset, validation=validation)

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16}[self.dtype]
