"""Gemma 4's vision path (tower + `embed_vision`) as an export-ready module: one image per call.

Hugging Face's tower takes the processor's patches padded to `max_soft_tokens * k^2` rows (padding at
position (-1, -1)), masks the padding out of attention, and average-pools the k x k patch windows into
soft tokens with a one-hot matrix built from the positions. With one image per call the host
(`tower_inputs`) does the position-only work instead: it drops the padding rows (they are masked as
keys and zeroed before pooling, so the real rows' values do not depend on them) and reorders the
patches window by window, in HF's soft-token order. The graph then needs no mask at all, pooling is
a reshape and a mean, and its inputs are the real patches and their (x, y) positions
[m, k^2, ...], m (the image's soft tokens) the one symbolic dim. In the graph: the learned 2-D
position embedding (a gather by x and y), the axial rotary angles (from the same positions), the
layers, pooling, `standardize`, and the multimodal embedder.

Output: `vision_embeds` [m, text_hidden], exactly what Gemma4Model puts at the image's soft-token
positions. Parameter names are the checkpoint's with `model.` stripped (`vision_tower.*`,
`embed_vision.*`), so weights load by name.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dflash_cli.modeling.layers import RMSNorm, apply_rope, rms_normalize

CHECKPOINT_PREFIXES = ("model.vision_tower.", "model.embed_vision.")  # this module's tensors in a checkpoint
STRIP = "model."  # what to remove from those keys to get this module's names
INPUTS = ("pixel_values", "pixel_position_ids")
OUTPUTS = ("vision_embeds",)


def _vision(cfg):
    return getattr(cfg, "vision_config", None) or cfg


def tower_inputs(pixel_values, image_position_ids, cfg) -> dict[str, np.ndarray]:
    """One image's graph feeds from its processor outputs (`pixel_values` [(1,) P, 3 p^2] and
    `image_position_ids` [(1,) P, 2], padded or not): its real patches, grouped by pooling window.

    The window of a patch is Gemma4VisionPooler._avg_pool_by_positions' `kernel_idxs`
    (x // k + (width // k) * (y // k)), which is also the soft token's index in HF's output order.
    """
    k = _vision(cfg).pooling_kernel_size
    pixels = np.asarray(pixel_values, np.float32)
    positions = np.asarray(image_position_ids, np.int64)
    pixels, positions = pixels.reshape(-1, pixels.shape[-1]), positions.reshape(-1, 2)
    real = ~(positions == -1).all(-1)  # HF's padding rule
    pixels, positions = pixels[real], positions[real]
    width = positions[:, 0].max() + 1
    window = positions[:, 0] // k + (width // k) * (positions[:, 1] // k)
    m = len(positions) // (k * k)
    if m * k * k != len(positions) or not (np.bincount(window, minlength=m) == k * k).all():
        raise ValueError(f"the image's {len(positions)} patches do not tile {k}x{k} pooling windows")
    order = np.argsort(window, kind="stable")
    return {
        "pixel_values": np.ascontiguousarray(pixels[order].reshape(m, k * k, -1)),
        "pixel_position_ids": np.ascontiguousarray(positions[order].reshape(m, k * k, 2)),
    }


class _ClippableLinear(nn.Module):
    """Gemma4ClippableLinear: with `use_clipped_linears` the checkpoint holds input/output bounds.
    Clamped with Where, not Clip (Clip is not on the QAIC op allow-list); a bound of +-inf is a no-op."""

    def __init__(self, cfg, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.clipped = cfg.use_clipped_linears
        if self.clipped:
            for name, value in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                # checkpoint tensors (buffers in Hugging Face's module): parameters here, so the export streams them
                setattr(self, name, nn.Parameter(torch.tensor(value * float("inf")), requires_grad=False))

    @staticmethod
    def _clamp(x, lo, hi):
        x = torch.where(x < lo, lo.to(x.dtype), x)
        return torch.where(x > hi, hi.to(x.dtype), x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = self.linear(self._clamp(x, self.input_min, self.input_max))
        return self._clamp(x, self.output_min, self.output_max)


class _Attention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = _ClippableLinear(cfg, cfg.hidden_size, self.heads * self.head_dim)
        self.k_proj = _ClippableLinear(cfg, cfg.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = _ClippableLinear(cfg, cfg.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = _ClippableLinear(cfg, self.heads * self.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """apply_multidimensional_rope: the head's first half rotates by x, its second half by y."""
        h, n, d = x.shape
        return apply_rope(x.reshape(h, n, 2, d // 2), cos, sin).reshape(h, n, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, d, kvh = x.shape[1], self.head_dim, self.kv_heads
        q = self.q_norm(self.q_proj(x).reshape(n, self.heads, d)).transpose(0, 1)  # [h, n, d]
        k = self.k_norm(self.k_proj(x).reshape(n, kvh, d)).transpose(0, 1)
        v = rms_normalize(self.v_proj(x).reshape(n, kvh, d).float(), self.eps).to(x.dtype).transpose(0, 1)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        # grouped heads without repeating K/V: query head i reads KV head i // groups, as repeat_kv
        qg = q.reshape(kvh, -1, d)  # [kvh, groups * n, d]
        probs = torch.softmax(torch.matmul(qg, k.transpose(-1, -2)).float(), dim=-1).to(x.dtype)  # scaling 1
        out = torch.matmul(probs, v).reshape(self.heads, n, d)
        return self.o_proj(out.transpose(0, 1).reshape(1, n, self.heads * d))


class _Mlp(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        if cfg.hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(f"vision MLP activation {cfg.hidden_activation!r} is not supported")
        self.gate_proj = _ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = _ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = _ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _PatchEmbedder(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, cfg.position_embedding_size, cfg.hidden_size))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # the processor leaves pixels in [0, 1]; the model maps them to [-1, 1]
        table = self.position_embedding_table
        return self.input_proj(2 * (pixels - 0.5)) + table[0][positions[..., 0]] + table[1][positions[..., 1]]


class _Encoder(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))


class _Tower(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.patch_embedder = _PatchEmbedder(cfg)
        self.encoder = _Encoder(cfg)
        self.standardize = cfg.standardize
        if self.standardize:
            self.std_bias = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)


class _Embedder(nn.Module):
    """Gemma4MultimodalEmbedder: an RMSNorm without scale, then the projection to the text width."""

    def __init__(self, vcfg, text_hidden: int) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(vcfg.hidden_size, text_hidden, bias=False)
        self.eps = vcfg.rms_norm_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(rms_normalize(x.float(), self.eps).to(x.dtype))


class Gemma4VisionEncoder(nn.Module):
    """From the whole Gemma4Config (the embedder needs the text width)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionRotaryEmbedding

        vcfg = cfg.vision_config
        self.vision_tower = _Tower(vcfg)
        self.embed_vision = _Embedder(vcfg, cfg.text_config.hidden_size)
        inv_freq, _ = Gemma4VisionRotaryEmbedding.compute_axial_rope_parameters(vcfg)  # its scaling is 1
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.window = vcfg.pooling_kernel_size**2
        self.root_hidden = vcfg.hidden_size**0.5
        self.patch_width = 3 * vcfg.patch_size**2

    def io_names(self) -> tuple[list[str], list[str]]:
        return list(INPUTS), list(OUTPUTS)

    def use_prefix_cache(self, on: bool = True) -> None:
        """No cache: the export asks every graph's module (the language graphs have two forms)."""

    def forward(self, pixel_values: torch.Tensor, pixel_position_ids: torch.Tensor) -> torch.Tensor:
        """pixel_values [m, k^2, 3 p^2], pixel_position_ids [m, k^2, 2] (x, y): tower_inputs' order."""
        tower = self.vision_tower
        positions = pixel_position_ids.flatten(0, 1)
        # [1, n, D] throughout: a batch dim makes every projection a MatMul (2-D inputs export as Gemm)
        x = tower.patch_embedder(pixel_values.flatten(0, 1)[None], positions[None])
        freqs = positions[..., None].float() * self.inv_freq  # [n, 2, head_dim / 4]: x's angles, then y's
        angles = torch.cat((freqs, freqs), dim=-1)  # [n, 2, head_dim / 2]
        cos, sin = angles.cos(), angles.sin()
        for layer in tower.encoder.layers:
            x = layer(x, cos, sin)
        pooled = x.reshape(-1, self.window, x.shape[-1]).float().mean(1)  # [m, D]: one soft token per window
        if tower.standardize:  # (pooled * root - bias) * scale, with no large intermediate (fp16 stays finite)
            pooled = pooled * (self.root_hidden * tower.std_scale.float()) - tower.std_bias.float() * tower.std_scale
        else:
            pooled = pooled * self.root_hidden
        return self.embed_vision(pooled.to(x.dtype)[None])[0]
