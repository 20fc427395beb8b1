"""Images into a vision-language prompt: the checkpoint's own processor and position rules, our graphs.

* `tower_inputs`: what Qwen3-VL's vision graph takes for one image, from its patch grid, computed by
  transformers' own helpers (the resampled position embedding's gather indices and weights, the 2-D
  rotary positions), grouped by merge unit as the graph wants them (Gemma 4's: vision_gemma4.py).
* `image_prompt`: the prompt's per-slot vision inputs (vision_feeds.ImagePrompt): each image's tower
  outputs at its image tokens, and M-RoPE positions from Hugging Face's own `get_rope_index`;
  `gemma4_image_prompt` the same for Gemma 4 (no M-RoPE; each image's tokens a group of their own).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from dflash_cli.vision.feeds import ImagePrompt


def tower_inputs(pixel_values: np.ndarray, grid_thw, vcfg) -> dict[str, np.ndarray]:
    """One image's vision-graph feeds: pixel rows [n, width] and its grid (t, h, w), n = t * h * w."""
    import torch
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    grid = torch.as_tensor(np.asarray(grid_thw, np.int64).reshape(1, 3))
    merge = vcfg.spatial_merge_size
    side = int(vcfg.num_position_embeddings**0.5)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid, num_grid_per_side=side, mode="bilinear", align_corners=True, spatial_merge_size=merge
    )
    positions = get_vision_position_ids(grid, merge)
    unit = merge * merge

    def grouped(a) -> np.ndarray:
        a = np.asarray(a)
        return np.ascontiguousarray(a.reshape(a.shape[0] // unit, unit, *a.shape[1:]))

    return {
        "pixel_values": grouped(np.asarray(pixel_values, np.float32)),
        "interp_indices": grouped(indices.numpy().astype(np.int64)),
        "interp_weights": grouped(weights.numpy().astype(np.float32)),
        "rope_positions": grouped(positions.numpy().astype(np.int64)),
    }


def _multimodal_model_class(full_cfg):
    """Hugging Face's multimodal model class of the config (its rope-index rule): the family's `mrope_model`."""
    import importlib

    from dflash_cli.families import family_for

    module, _, name = family_for(full_cfg.model_type).mrope_model.rpartition(".")
    return getattr(importlib.import_module(module), name)


def rope_index(input_ids: list[int], grids: np.ndarray, full_cfg) -> tuple[np.ndarray, int]:
    """M-RoPE positions [P, 3] of a prompt and the offset after it, by Hugging Face's own rule."""
    import torch

    model = _multimodal_model_class(full_cfg)
    ids = torch.tensor([input_ids])
    types = (ids == full_cfg.image_token_id).int()
    shim = SimpleNamespace(
        config=full_cfg, get_vision_position_ids=lambda *a, **k: model.get_vision_position_ids(None, *a, **k)
    )
    grid = torch.as_tensor(np.asarray(grids, np.int64).reshape(-1, 3)) if len(grids) else None
    positions, delta = model.get_rope_index(shim, ids, types, image_grid_thw=grid)
    return positions[:, 0].T.numpy().astype(np.int64), int(delta.reshape(-1)[0])


def image_prompt(
    input_ids: list[int], pixel_values: np.ndarray, grids: np.ndarray, full_cfg, run_tower: Callable
) -> ImagePrompt:
    """The prompt's ImagePrompt; `run_tower(feeds)` runs the vision graph on one image's feeds and returns
    (vision_embeds [m, H], deepstack_embeds [k, m, H])."""
    vcfg = full_cfg.vision_config
    ids = np.asarray(input_ids)
    slots = np.flatnonzero(ids == full_cfg.image_token_id)
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    unit = vcfg.spatial_merge_size**2
    tokens = [int(g.prod()) // unit for g in grids]
    if len(slots) != sum(tokens):
        raise ValueError(f"the prompt has {len(slots)} image tokens, its images {sum(tokens)}")
    embeds, deep, start = [], [], 0
    k = len(getattr(vcfg, "deepstack_visual_indexes", None) or ())  # Qwen3.5: none
    for grid in grids:
        rows = int(grid.prod())
        out = run_tower(tower_inputs(pixel_values[start : start + rows], grid, vcfg))
        embeds.append(out[0])
        if k:
            deep.append(np.moveaxis(out[1], 0, 1))  # [m, k, H]
        start += rows
    P = len(ids)
    H = full_cfg.text_config.hidden_size
    rope, offset = rope_index(list(ids), grids, full_cfg)
    prompt = ImagePrompt(
        rope=rope,
        embeds=np.zeros((P, H), np.float32),
        mask=np.zeros(P, np.float32),
        deepstack=np.zeros((P, k, H), np.float32) if k else None,
        offset=offset,
    )
    if len(slots):
        prompt.embeds[slots] = np.concatenate(embeds)
        prompt.mask[slots] = 1.0
        if k:
            prompt.deepstack[slots] = np.concatenate(deep)
    return prompt


def gemma4_image_prompt(
    input_ids: list[int], pixel_values: np.ndarray, position_ids: np.ndarray, full_cfg, run_tower: Callable
) -> ImagePrompt:
    """Gemma 4's ImagePrompt from the processor's per-image `pixel_values` [N, patches, 3 p^2] and
    `image_position_ids` [N, patches, 2] (padded to one length); `run_tower(feeds)` returns (vision_embeds,)."""
    from dflash_cli.modeling.vision_gemma4 import tower_inputs as gemma4_tower_inputs

    ids = np.asarray(input_ids)
    slots = np.flatnonzero(ids == full_cfg.image_token_id)
    runs = np.split(slots, np.flatnonzero(np.diff(slots) != 1) + 1) if len(slots) else []
    feeds = [gemma4_tower_inputs(p, q, full_cfg) for p, q in zip(pixel_values, position_ids)]
    tokens = [len(f["pixel_values"]) for f in feeds]
    if [len(r) for r in runs] != tokens:
        raise ValueError(f"the prompt's image token runs are {[len(r) for r in runs]} long, its images give {tokens}")
    P, H = len(ids), full_cfg.text_config.hidden_size
    prompt = ImagePrompt(
        embeds=np.zeros((P, H), np.float32), mask=np.zeros(P, np.float32), groups=np.zeros(P, np.int64)
    )
    for k, (run, f) in enumerate(zip(runs, feeds)):
        (prompt.embeds[run],) = run_tower(f)
        prompt.mask[run] = 1.0
        prompt.groups[run] = k + 1  # Hugging Face's block of contiguous image tokens
    return prompt
