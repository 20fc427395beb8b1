"""The vision inputs of a vision-language target's calls, derived from each call's cache positions.

Every call of such a target takes, beside `input_ids` / `position_ids`, `vision_embeds` and
`vision_mask`, and as its model needs `rope_position_ids` and `deepstack_embeds` (Qwen3-VL,
modeling/vl_target.py) or `image_groups` (Gemma 4, modeling/gemma4_target.py). The decoding loops,
the compile checks and validation only ever give the first two: a session fills the rest here, row by
row from `position_ids`, so the loops need not know images exist. With no image in the sequence a row
gets the neutral values (M-RoPE positions equal to its slot, zero features, mask 0, group 0). With an
image prompt (`ImagePrompt`, set on the session for one sequence) a prompt row gets that prompt's
values and a later row its slot plus the prompt's M-RoPE offset. Padding rows (position -1) get the
neutral values of 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VISION_INPUTS = ("rope_position_ids", "vision_embeds", "vision_mask", "deepstack_embeds", "image_groups")
REQUIRED = ("vision_embeds", "vision_mask")  # what makes a graph a vision-language target's


@dataclass
class ImagePrompt:
    """Per prompt slot: image features [P, H] (zeros at text) and mask [P] (1.0 at image tokens); Qwen3-VL's
    M-RoPE positions [P, 3] and deepstack features [P, k, H], with `offset` (M-RoPE position minus slot
    after the prompt); Gemma 4's image groups [P] (image i's tokens i + 1, text 0)."""

    embeds: np.ndarray
    mask: np.ndarray
    rope: np.ndarray | None = None
    deepstack: np.ndarray | None = None
    offset: int = 0
    groups: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.mask.shape[0])

    def image_spans(self) -> list[tuple[int, int]]:
        """[start, end) of each image whose tokens must share one call (Gemma 4's bidirectional images)."""
        if self.groups is None:
            return []
        spans = []
        for g in np.unique(self.groups[self.groups > 0]):
            where = np.flatnonzero(self.groups == g)
            spans.append((int(where[0]), int(where[-1]) + 1))
        return spans


def needs_vision_feeds(input_names) -> bool:
    return all(n in input_names for n in REQUIRED)


def vision_feeds(
    positions: np.ndarray, shapes: dict[str, tuple], prompt: ImagePrompt | None, dtype=np.float32
) -> dict[str, np.ndarray]:
    """The graph's vision inputs (those `shapes` names: each input's static trailing dims, vision_embeds
    (H,), deepstack_embeds (k, H)) for rows at `positions` [b, s]."""
    positions = np.asarray(positions, dtype=np.int64)
    b, s = positions.shape
    out: dict[str, np.ndarray] = {}
    for name, dims in shapes.items():
        if name == "rope_position_ids":
            out[name] = np.repeat(np.maximum(positions, 0)[..., None], 3, axis=-1)
        elif name == "image_groups":
            out[name] = np.zeros((b, s), np.int64)
        else:
            out[name] = np.zeros((b, s, *dims), dtype)
    if prompt is None:
        return out
    if "rope_position_ids" in out:
        out["rope_position_ids"] += np.where(positions >= prompt.length, prompt.offset, 0)[..., None]
    inside = (positions >= 0) & (positions < prompt.length)
    if inside.any():
        slots = positions[inside]
        per_slot = {
            "rope_position_ids": prompt.rope,
            "vision_embeds": prompt.embeds,
            "vision_mask": prompt.mask,
            "deepstack_embeds": prompt.deepstack,
            "image_groups": prompt.groups,
        }
        for name in out:
            out[name][inside] = per_slot[name][slots]
    return out


def static_trailing_dims(inputs) -> dict[str, tuple]:
    """{input: its dims after [batch, seq]} for the graph's vision inputs, from ONNX Runtime's input metadata."""
    return {i.name: tuple(int(d) for d in i.shape[2:]) for i in inputs if i.name in VISION_INPUTS}


def float_type(inputs) -> type:
    types = {i.name: i.type for i in inputs}
    return np.float16 if types.get("vision_embeds") == "tensor(float16)" else np.float32


class VisionFeeder:
    """A session's part: complete a call's feeds (see the module docstring)."""

    def __init__(self, inputs) -> None:
        names = [i.name for i in inputs]
        self.active = needs_vision_feeds(names)
        self.shapes = static_trailing_dims(inputs) if self.active else {}
        self.dtype = float_type(inputs)
        self.prompt: ImagePrompt | None = None

    def complete(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.active or all(n in feeds for n in self.shapes):
            return feeds
        return {**vision_feeds(feeds["position_ids"], self.shapes, self.prompt, self.dtype), **feeds}
