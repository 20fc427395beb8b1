"""fp32 logit gap where fp16 greedy output first departs from fp32: a near tie, or a real fault?

fp16 rounding can only flip a greedy choice whose fp32 logits are nearly tied; a conversion bug
(an overflowing `fc`, a clipped mask) flips clear choices. The gap of the fp32 winner over the fp16
token, and the fp16 token's fp32 rank, tell the two apart. Computed with the Hugging Face target in
PyTorch (fp32), independent of the ONNX graphs being judged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class LogitGap:
    """Callable: (committed ids, fp32 token, fp16 token) -> {"gap", "fp16_rank"} at the next position."""

    def __init__(self, target_dir: Path) -> None:
        import torch

        from dflash_cli.exporting.hf_reference import hf_text_lm

        self._torch = torch
        self.model = hf_text_lm(target_dir)

    def __call__(self, ids: list[int], fp32_token: int, fp16_token: int) -> dict[str, Any]:
        torch = self._torch
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0, -1]
        gap = float(logits[fp32_token] - logits[fp16_token])
        # rank 1 = the fp32 argmax itself; a near tie shows up as rank 2 with a small gap
        rank = int((logits > logits[fp16_token]).sum().item()) + 1
        return {"gap": gap, "fp16_rank": rank}
