"""A vision-language target's language model (Qwen3-VL): the Qwen3 target plus what images bring in.

Three things differ from a text target, each an input of every call (a text-only call feeds the
neutral values, vision/feeds.py):
* `rope_position_ids` [b, s, 3]: M-RoPE's (t, h, w) positions. `position_ids` stays the cache slot
  (what a query sees); the rotation follows these, which equal the slot plus an offset for text and
  walk the image grid for image tokens. On text all three are equal, and M-RoPE is RoPE.
* `vision_embeds` [b, s, H] with `vision_mask` [b, s] (1.0 at image tokens): the vision tower's
  output replaces the token embedding there (Hugging Face's masked_scatter).
* `deepstack_embeds` [b, s, k, H]: added to the hidden state after each of the first k layers
  (zeros at text tokens, so adding them everywhere changes nothing there). The DFlash taps read a
  layer's output before that addition, as Hugging Face's hidden_states do.
"""

from __future__ import annotations

import torch

from dflash_cli.modeling.target import StaticCacheTarget

VL_INPUTS = ("rope_position_ids", "vision_embeds", "vision_mask", "deepstack_embeds")


def mrope_axes(head_dim: int, section: list[int]) -> torch.Tensor:
    """Which of t (0), h (1), w (2) each rotary column follows: Qwen3-VL interleaves them, column j of
    the first `3 * section[a]` following axis a when j % 3 == a (t everywhere else); both halves alike."""
    half = head_dim // 2
    axes = torch.zeros(half, dtype=torch.long)
    for a in (1, 2):
        axes[a : 3 * section[a] : 3] = a
    return torch.cat((axes, axes))


def mrope_axes_of(hf_config, head_dim: int) -> torch.Tensor:
    """mrope_axes over the rotated part of the head (Qwen3.5 rotates a quarter of it)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return mrope_axes(int(head_dim * params.get("partial_rotary_factor", 1.0)), mrope_section_of(hf_config))


def mrope_section_of(hf_config) -> list[int]:
    """M-RoPE's (t, h, w) split as Hugging Face's model takes it: the config's, or where the config leaves it
    out, the default of the model's own rotary embedding (Qwen3.5 [11, 11, 10], Qwen3-VL [24, 20, 20])."""
    import importlib

    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("mrope_section") is not None:
        return list(params["mrope_section"])
    modeling = importlib.import_module(type(hf_config).__module__.replace(".configuration_", ".modeling_"))
    rotary = next(cls for name, cls in vars(modeling).items() if name.endswith("TextRotaryEmbedding"))
    return list(rotary(hf_config).mrope_section)


def mrope_cos_sin(rotary, rope_position_ids: torch.Tensor, axes: torch.Tensor):
    """(cos, sin) [b, 1, s, d] with each rotary column at the position of its axis (t, h or w)."""
    per_axis = [rotary(rope_position_ids[..., a]) for a in range(3)]  # each (cos, sin) [b, 1, s, d]
    axes = axes.to(rope_position_ids.device)

    def pick(i: int) -> torch.Tensor:
        t, h, w = (p[i] for p in per_axis)
        return torch.where(axes == 1, h, torch.where(axes == 2, w, t))

    return pick(0), pick(1)


def merge_image_rows(x: torch.Tensor, vision_embeds: torch.Tensor, vision_mask: torch.Tensor) -> torch.Tensor:
    """The vision tower's rows in place of the token embedding at image tokens (Hugging Face's masked_scatter)."""
    return torch.where(vision_mask[..., None] > 0.5, vision_embeds.to(x.dtype), x)


class VisionLanguageTarget(StaticCacheTarget):
    extra_inputs = VL_INPUTS
    batched_prefix = False  # image inputs per call: one sequence per call

    def __init__(self, hf_config, target_layer_ids: list[int], emit_logits: bool = False, deepstack: int = 0) -> None:
        super().__init__(hf_config, target_layer_ids, emit_logits)
        self.deepstack = deepstack
        self.register_buffer("mrope_axes", None, persistent=False)
        self.computed_buffers(hf_config)

    def computed_buffers(self, hf_config) -> None:
        """Buffers computed from the config, not loaded (again on the CPU after a build on the meta device)."""
        self.mrope_axes = mrope_axes_of(hf_config, self.spec.head_dim)

    def rope(self, position_ids, rope_position_ids, *rest):
        return mrope_cos_sin(self.rotary, rope_position_ids, self.mrope_axes)

    def embed(self, input_ids, rope_position_ids, vision_embeds, vision_mask, deepstack_embeds):
        return merge_image_rows(self.model.embed_tokens(input_ids), vision_embeds, vision_mask)

    def after_layer(self, i, x, rope_position_ids, vision_embeds, vision_mask, deepstack_embeds):
        return x + deepstack_embeds[:, :, i].to(x.dtype) if i < self.deepstack else x

    def text_inputs(self, position_ids: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
        """The neutral extra inputs of a text-only call at `position_ids` [b, s]."""
        b, s = position_ids.shape
        h = self.spec.hidden
        return [
            position_ids[..., None].expand(b, s, 3).clone(),
            torch.zeros(b, s, h, dtype=dtype),
            torch.zeros(b, s, dtype=dtype),
            torch.zeros(b, s, max(self.deepstack, 1), h, dtype=dtype),
        ]
