"""The vision path's graph of a vision-language target (`vision.onnx`): Qwen3-VL's tower
(modeling/vision_qwen3_vl.py) or Gemma 4's tower and embedder (modeling/vision_gemma4.py).

One image per call: its image tokens `m` are the one symbolic dim (every input is grouped by what
becomes one token, [m, group, ...], so no divisibility has to be proven to the tracer). Traced whole
(a tower has a few dozen small blocks), its weights streamed like the language model's from the
target store (text_path indexes them without the checkpoint's `model.` prefix).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

GRAPH = "vision"
CHECK_COPY = "vision-check"  # a lean export's tower with its weights, for validation only (never published)


def full_config(src: Path):
    from dflash_cli.modeling.loading import multimodal_config

    return multimodal_config(src)


def pooled_tower(cfg) -> bool:
    """Whether the target's tower pools patches per window (Gemma 4's tower and embedder), not merges them."""
    from dflash_cli.families import traits_of

    return traits_of(cfg.model_type).pooled_vision


def build_vision(src: Path, device="meta", dtype=torch.float32):
    cfg = full_config(src)
    with torch.device(device):
        if pooled_tower(cfg):
            from dflash_cli.modeling.vision_gemma4 import Gemma4VisionEncoder

            module = Gemma4VisionEncoder(cfg).eval()
        else:
            from dflash_cli.modeling.vision_qwen3_vl import VisionEncoder

            module = VisionEncoder(cfg.vision_config).eval()
    return module.to(dtype)


def store_name(src: Path):
    """The tower's parameter name -> its name in the target store."""
    if pooled_tower(full_config(src)):
        return lambda n: n  # `vision_tower.*` / `embed_vision.*`, as the module names them
    return lambda n: "visual." + n


def example_inputs(module, dtype: torch.dtype, m: int = 6) -> tuple:
    """Inputs for `m` image tokens (an example size unlike the tower's own dims, so it stays symbolic)."""
    meta = torch.device("meta")
    if hasattr(module, "window"):  # Gemma 4: patches grouped by pooling window, with their (x, y)
        return (
            torch.zeros(m, module.window, module.patch_width, dtype=dtype, device=meta),
            torch.zeros(m, module.window, 2, dtype=torch.long, device=meta),
        )
    u = module.merge_unit
    return (
        torch.zeros(m, u, module.patch_width, dtype=dtype, device=meta),
        torch.zeros(m, u, 4, dtype=torch.long, device=meta),
        torch.zeros(m, u, 4, dtype=dtype, device=meta),
        torch.zeros(m, u, 2, dtype=torch.long, device=meta),
    )


# The image token counts an accelerator's vision program is specialized for (its one symbolic dim, named
# seq_len like the language graphs'): Gemma 4's processor's default cap, and a 512x512 image for Qwen.
IMAGE_TOKENS = {"gemma4": 280, "qwen": 256}


def facts(module) -> dict[str, Any]:
    ins, outs = module.io_names()
    gemma = hasattr(module, "window")
    extra = (
        {"window": module.window}
        if gemma
        else {"merge_unit": module.merge_unit, "deepstack": len(module.deepstack_visual_indexes)}
    )
    tokens = IMAGE_TOKENS["gemma4" if gemma else "qwen"]
    return {"onnx": f"{GRAPH}.onnx", "inputs": ins, "outputs": outs, "seq_lens": {"image": tokens}, **extra}


def inv_freq(src: Path) -> torch.Tensor:
    """The tower's rotary frequencies (computed from the config, never loaded)."""
    cfg = full_config(src)
    if pooled_tower(cfg):
        from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionRotaryEmbedding

        return Gemma4VisionRotaryEmbedding.compute_axial_rope_parameters(cfg.vision_config)[0].float()
    from dflash_cli.modeling.vision_qwen3_vl import axial_inv_freq

    return axial_inv_freq(cfg.vision_config)
