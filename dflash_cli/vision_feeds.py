"""The vision inputs of a vision-language target's calls, derived from each call's cache positions.

Every call of such a target (modeling/vl_target.py) takes `rope_position_ids`, `vision_embeds`,
`vision_mask` and `deepstack_embeds` beside `input_ids` / `position_ids`. The decoding loops, the
compile checks and validation only ever give the latter two: a session fills the rest here, row by row
from `position_ids`, so the loops need not know images exist. With no image in the sequence a row gets
the neutral values (M-RoPE positions equal to its slot, zero features, mask 0). With an image prompt
(`ImagePrompt`, set on the session for one sequence) a prompt row gets that prompt's values and a later
row its slot plus the prompt's M-RoPE offset. Padding rows (position -1) get the neutral values of 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VL_INPUTS = ("rope_position_ids", "vision_embeds", "vision_mask", "deepstack_embeds")


@dataclass
class ImagePrompt:
    """Per prompt slot: M-RoPE positions [P, 3], image features [P, H] (zeros at text), mask [P] (1.0 at
    image tokens), deepstack features [P, k, H]; `offset`: M-RoPE position minus slot after the prompt."""

    rope: np.ndarray
    embeds: np.ndarray
    mask: np.ndarray
    deepstack: np.ndarray
    offset: int

    @property
    def length(self) -> int:
        return int(self.rope.shape[0])


def needs_vision_feeds(input_names) -> bool:
    return all(n in input_names for n in VL_INPUTS)


def vision_feeds(
    positions: np.ndarray, shapes: dict[str, tuple], prompt: ImagePrompt | None, dtype=np.float32
) -> dict[str, np.ndarray]:
    """The four inputs for rows at `positions` [b, s]; `shapes` gives each input's static trailing dims
    (vision_embeds: (H,), deepstack_embeds: (k, H))."""
    positions = np.asarray(positions, dtype=np.int64)
    b, s = positions.shape
    hidden = shapes["vision_embeds"]
    stack = shapes["deepstack_embeds"]
    rope = np.repeat(np.maximum(positions, 0)[..., None], 3, axis=-1)
    embeds = np.zeros((b, s, *hidden), dtype)
    mask = np.zeros((b, s), dtype)
    deep = np.zeros((b, s, *stack), dtype)
    if prompt is not None:
        rope = rope + np.where(positions >= prompt.length, prompt.offset, 0)[..., None]
        inside = (positions >= 0) & (positions < prompt.length)
        if inside.any():
            slots = positions[inside]
            rope[inside] = prompt.rope[slots]
            embeds[inside] = prompt.embeds[slots]
            mask[inside] = prompt.mask[slots]
            deep[inside] = prompt.deepstack[slots]
    return {"rope_position_ids": rope, "vision_embeds": embeds, "vision_mask": mask, "deepstack_embeds": deep}


def static_trailing_dims(inputs) -> dict[str, tuple]:
    """{input: its dims after [batch, seq]} for the four inputs, from ONNX Runtime's input metadata."""
    return {i.name: tuple(int(d) for d in i.shape[2:]) for i in inputs if i.name in VL_INPUTS}


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
        if not self.active or all(n in feeds for n in VL_INPUTS):
            return feeds
        return {**vision_feeds(feeds["position_ids"], self.shapes, self.prompt, self.dtype), **feeds}
