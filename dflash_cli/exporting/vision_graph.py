"""The vision tower's graph of a vision-language target (`vision.onnx`, modeling/vision_qwen3_vl.py).

One image per call: its merged tokens `m` are the one symbolic dim (every input is grouped by merge
unit, [m, merge^2, ...], so no divisibility has to be proven to the tracer). Traced whole (a tower has
a few dozen small blocks), its weights streamed like the language model's from the target store's
`visual.*` tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_cli.modeling.vision_qwen3_vl import INPUTS, OUTPUTS, VisionEncoder, axial_inv_freq

GRAPH = "vision"
CHECK_COPY = "vision-check"  # a lean export's tower with its weights, for validation only (never published)
VISION_STORE_PREFIX = "visual."  # text_path indexes the tower under this prefix


def tower_config(src: Path):
    from dflash_cli.modeling.loading import multimodal_config

    return multimodal_config(src).vision_config


def build_vision(src: Path, device="meta", dtype=torch.float32) -> VisionEncoder:
    with torch.device(device):
        module = VisionEncoder(tower_config(src)).eval()
    return module.to(dtype)


def example_inputs(module: VisionEncoder, dtype: torch.dtype, m: int = 6) -> tuple:
    """Inputs for `m` merged tokens (an example size unlike the tower's own dims, so it stays symbolic)."""
    meta = torch.device("meta")
    u = module.merge_unit
    return (
        torch.zeros(m, u, module.patch_width, dtype=dtype, device=meta),
        torch.zeros(m, u, 4, dtype=torch.long, device=meta),
        torch.zeros(m, u, 4, dtype=dtype, device=meta),
        torch.zeros(m, u, 2, dtype=torch.long, device=meta),
    )


def facts(module: VisionEncoder) -> dict[str, Any]:
    return {
        "onnx": f"{GRAPH}.onnx",
        "inputs": list(INPUTS),
        "outputs": list(OUTPUTS),
        "merge_unit": module.merge_unit,
        "deepstack": len(module.deepstack_visual_indexes),
    }


def inv_freq(src: Path) -> torch.Tensor:
    return axial_inv_freq(tower_config(src))
