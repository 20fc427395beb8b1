"""Qwen3-VL's vision tower as an export-ready module: one image per call, every input a plain tensor.

Hugging Face's tower takes the processor's patches and `grid_thw` and derives, per image, the
resampled learned position embedding (gather indices and bilinear weights), the 2-D rotary positions
and the attention boundaries between images. Those depend on the grid alone, so the host computes
them with transformers' own helpers (vision_inputs.py) and the graph takes them as inputs; one image
per call needs no boundaries at all (Hugging Face's per-image attention gives the same values).

Outputs: `vision_embeds` [n / merge^2, H] (the merger's, one row per image token of the prompt) and
`deepstack_embeds` [k, n / merge^2, H] (the deepstack mergers' after blocks `deepstack_visual_indexes`,
added to the language model's hidden states after its first k layers at the image tokens).
Parameter names follow the checkpoint's `model.visual.*` so weights load by name.
"""

from __future__ import annotations

import torch
from torch import nn

VISION_PREFIX = "model.visual."  # the tower's tensors in a Qwen3-VL checkpoint
INPUTS = ("pixel_values", "interp_indices", "interp_weights", "rope_positions")
OUTPUTS = ("vision_embeds", "deepstack_embeds")


def axial_inv_freq(cfg) -> torch.Tensor:
    """The 2-D rotary frequencies: half the angles follow the patch's row, half its column."""
    head_dim = cfg.hidden_size // cfg.num_heads
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    spatial = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


class _PatchEmbed(nn.Module):
    """A Conv3d whose stride is its kernel: one linear map of each flattened patch (a MatMul in ONNX)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=(t, p, p), stride=(t, p, p), bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return nn.functional.linear(patches, w.reshape(w.shape[0], -1), self.proj.bias)


class _Attention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from dflash_cli.modeling.layers import apply_rope

        n = x.shape[1]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 2, 0, 3)  # each [heads, n, d]
        q, k = apply_rope(q.float(), cos, sin).to(x.dtype), apply_rope(k.float(), cos, sin).to(x.dtype)
        d = q.shape[-1]
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * (d**-0.5), dim=-1)
        out = torch.matmul(probs, v)  # [heads, n, d]
        return self.proj(out.transpose(0, 1).reshape(1, n, -1))


class _Block(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = _Attention(cfg)
        self.mlp = _Mlp(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _Mlp(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)
        self.approximate = "tanh" if act == "gelu_pytorch_tanh" else "none"
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision MLP activation {act!r} is not supported")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(x), approximate=self.approximate))


class _Merger(nn.Module):
    """merge^2 neighbouring patches (consecutive rows: the processor orders them so) into one token.
    `postshuffle`: the deepstack mergers normalise after concatenating, the final one before."""

    def __init__(self, cfg, postshuffle: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(1, -1, self.width)) if self.postshuffle else self.norm(x).reshape(1, -1, self.width)
        return self.linear_fc2(nn.functional.gelu(self.linear_fc1(x)))


class VisionEncoder(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.patch_embed = _PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.merger = _Merger(cfg, postshuffle=False)
        # Qwen3.5's tower is this one without deepstack mergers (and without the deepstack output)
        self.deepstack_visual_indexes = list(getattr(cfg, "deepstack_visual_indexes", None) or ())
        self.deepstack_merger_list = nn.ModuleList(_Merger(cfg, True) for _ in self.deepstack_visual_indexes)
        self.register_buffer("inv_freq", axial_inv_freq(cfg), persistent=False)
        self.merge_unit = cfg.spatial_merge_size**2
        self.patch_width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2

    def io_names(self) -> tuple[list[str], list[str]]:
        return list(INPUTS), list(OUTPUTS if self.deepstack_visual_indexes else OUTPUTS[:1])

    def use_prefix_cache(self, on: bool = True) -> None:
        """No cache: the export asks every graph's module (the language graphs have two forms)."""

    def forward(self, pixel_values, interp_indices, interp_weights, rope_positions):
        """Every input grouped by merge unit: [m, merge^2, ...] (rows in the processor's order)."""
        pixel_values, interp_indices, interp_weights, rope_positions = (
            t.flatten(0, 1) for t in (pixel_values, interp_indices, interp_weights, rope_positions)
        )
        # [1, n, D] throughout: a batch dim makes every projection a MatMul (2-D inputs export as Gemm, which
        # the int8/int4 compile does not quantise)
        x = self.patch_embed(pixel_values)[None]
        x = x + (self.pos_embed(interp_indices) * interp_weights[..., None].to(x.dtype)).sum(1)[None]
        freqs = rope_positions[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]
        angles = freqs.reshape(freqs.shape[0], -1)  # rows' angles, then columns'
        angles = torch.cat((angles, angles), dim=-1)[None]  # [1, n, head_dim]
        cos, sin = angles.cos(), angles.sin()
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x)[0])
        return (self.merger(x)[0], torch.stack(deepstack)) if deepstack else self.merger(x)[0]
