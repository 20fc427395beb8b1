"""What an export is asked for: the pair's graph shapes and one options object (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Validation = Literal["off", "full", "reduced"]  # reduced: a few layers and vocabulary rows (validate.py)


# Where the target takes calls of any length, a lookup step of the hybrid (decoding/hybrid.py) may verify past
# the block, up to this many blocks: a copy (a loop, a quoted passage) runs on far past one block, and a verify
# of 32 tokens costs 1.7x one of 8 on the demo pair (2.75 vs 1.59 ms). The draft always proposes one block.
# Defined here, below decoding/, because the export sizes graphs by it and the build checks calls this long.
LOOKUP_BLOCKS = 4

# The draft's `draft_confidence` is a probability: it moves by p(1 - p) times its logit's error (2.6e-3 on the
# Qwen3-0.6B shape where the logits' own error was within bounds), and it only decides how many proposals get
# verified, never a token. So the graphs are held to this absolute bound on it, by export dtype.
CONFIDENCE_OUTPUT = "draft_confidence"
CONFIDENCE_ATOL = {"fp32": 0.05, "fp16": 0.2}


@dataclass(frozen=True)
class PairShape:
    block: int
    prefill: int
    ctx_len: int
    hidden: int

    @property
    def longest_call(self) -> int:
        """The most tokens one target call may carry: a prefill chunk, or a lookup step's long verify."""
        return max(self.prefill, LOOKUP_BLOCKS * self.block)


@dataclass(frozen=True)
class ExportOptions:
    dtype: Literal["fp32", "fp16"] = "fp32"  # weights and compute of the graphs
    logits: bool = False  # the graphs also output full logits (not only argmax tokens)
    opset: int = 18
    prefix_graphs: bool = True  # also target_prefix.onnx / draft_prefix.onnx, the prefix-cache form ORT runs
    validation: Validation = "full"
    # A lean export leaves out the checkpoint's weights (external_data.DEFERRED): an int8/int4 compile reads
    # them from the checkpoint, so a full-precision copy would only fill the cache.
    lean: bool = False
    # Above 1: also target_cb.onnx / draft_cb.onnx, whose retained caches hold this many sequences and whose
    # calls say which with `batch_index` (continuous batching on QAIC, modeling/slot_cache.py).
    full_batch_size: int = 0
    # How mixture-of-experts MLPs are written: ONNX Runtime's MoE op, or standard ops that gather each token's
    # experts (modeling/moe_gathered.py: what a QAIC compiler takes).
    moe_ops: Literal["ort", "gathered"] = "ort"

    @classmethod
    def of(
        cls, export: Any, validation: Validation, lean: bool = False, full_batch_size: int = 0, moe_ops: str = "ort"
    ) -> ExportOptions:
        """From a recipe's `export` section; `validation` as the stage decided it for the pair's size."""
        return cls(
            dtype=export.dtype,
            logits=export.logits,
            opset=export.opset,
            validation=validation,
            lean=lean,
            full_batch_size=full_batch_size,
            moe_ops=moe_ops,
        )

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16}[self.dtype]
