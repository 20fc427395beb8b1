"""Gemma 4's language model as an export-ready target (the dense 31B / 12B layout).

What differs from the Qwen3 target (transformers' models/gemma4 are the facts):
* two layer kinds with their own geometry: sliding-window layers (head_dim, num_key_value_heads, a
  RoPE of their own) and full-attention layers (global head_dim, their own KV heads, proportional RoPE
  rotating a fraction of the head; with `attention_k_eq_v` their values are their keys' projection);
* q, k and v are RMS-normalised per head (v without a weight) and attention scales by 1, not 1/sqrt(d);
* four norms per layer (before and after attention and MLP), a GELU-gated MLP, a learnt scalar on
  each layer's output, the embedding scaled by sqrt(hidden) in the checkpoint's dtype, and the
  logits soft-capped (cap * tanh(logits / cap): the argmax is unchanged, sampling sees the cap).
Per-layer input embeddings, KV sharing between layers and the MoE block (E2B/E4B, 26B-A4B) are
refused at convert (`unsupported`): each is a computation this module does not do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash_cli.modeling.layers import (
    RMSNorm,
    Rotary,
    ScaledEmbedding,
    append_cache,
    grouped_attention,
    rms_normalize,
    write_cache,
)
from dflash_cli.modeling.target import StaticCacheTarget

SLIDING, FULL = "sliding_attention", "full_attention"
VISION_INPUTS = ("vision_embeds", "vision_mask")
ROTARIES = {"rotary": SLIDING, "rotary_full": FULL}  # attribute -> the layer kind it serves


def unsupported(cfg: dict[str, Any]) -> str | None:
    """Why a Gemma 4 text config cannot be built, or None."""
    if cfg.get("hidden_size_per_layer_input"):
        return "per-layer input embeddings (hidden_size_per_layer_input, the E2B/E4B models)"
    if cfg.get("num_kv_shared_layers"):
        return "layers sharing another layer's KV cache (num_kv_shared_layers)"
    if cfg.get("enable_moe_block"):
        # Its experts are GELU-gated (GEGLU); ONNX Runtime 1.32's MoE / QMoE compute that on CUDA only, and
        # experts as gathered standard ops hold every expert unquantised (26B parameters in fp32).
        return (
            "the mixture-of-experts block (enable_moe_block, the 26B-A4B model), whose GELU-gated experts"
            " ONNX Runtime's CPU expert kernels do not compute"
        )
    if cfg.get("use_bidirectional_attention") == "all":
        return "bidirectional attention over all tokens"
    return None


def embed_scale(hidden: int, dtype_name: str | None) -> float:
    """sqrt(hidden) as the checkpoint's dtype holds it (bf16 rounds sqrt(5376) = 73.3 to 73.5), as
    Hugging Face's scaled embedding multiplies in the weights' dtype."""
    dtype = getattr(torch, str(dtype_name or "float32").removeprefix("torch."), torch.float32)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = torch.float32
    return float(torch.tensor(hidden**0.5, dtype=torch.float32, device="cpu").to(dtype).float())


class _Geometry:
    """One layer's attention shape: heads of KV, head width, whether values are the keys' projection."""

    def __init__(self, cfg, i: int) -> None:
        layer = cfg.per_layer_config[i]
        self.kind = cfg.layer_types[i]
        self.kv_heads = layer.num_key_value_heads
        self.head_dim = layer.head_dim
        self.k_eq_v = bool(cfg.attention_k_eq_v) and self.kind == FULL


class Gemma4Attention(nn.Module):
    def __init__(self, cfg, geo: _Geometry) -> None:
        super().__init__()
        h, d, bias = cfg.hidden_size, geo.head_dim, bool(cfg.attention_bias)
        self.heads, self.kv_heads, self.head_dim, self.eps = cfg.num_attention_heads, geo.kv_heads, d, cfg.rms_norm_eps
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = None if geo.k_eq_v else nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, self.eps)
        self.k_norm = RMSNorm(d, self.eps)
        self.prefix_cache = False

    def forward(self, x, cos, sin, positions, visible, past_k, past_v):
        from dflash_cli.modeling.layers import apply_rope

        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        raw_k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        raw_v = raw_k if self.v_proj is None else self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        k = self.k_norm(raw_k).transpose(1, 2)
        v = rms_normalize(raw_v.float(), self.eps).to(raw_v.dtype).transpose(1, 2)  # v_norm has no weight
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.prefix_cache:
            (new_k, keep_k), (new_v, keep_v) = append_cache(past_k, k), append_cache(past_v, v)
            return self.o_proj(grouped_attention(q, new_k, new_v, visible, scale=1.0)), keep_k, keep_v
        new_k, new_v = write_cache(past_k, positions, k), write_cache(past_v, positions, v)
        return self.o_proj(grouped_attention(q, new_k, new_v, visible, scale=1.0)), new_k, new_v


class _GeluGated(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Layer(nn.Module):
    def __init__(self, cfg, geo: _Geometry) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, geo)
        self.mlp = _GeluGated(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # a checkpoint tensor (a buffer in Hugging Face's module)

    def forward(self, x, cos, sin, positions, visible, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, positions, visible, past_k, past_v)
        x = x + self.post_attention_layernorm(a)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar.to(x.dtype), k, v


class _Body(nn.Module):
    def __init__(self, cfg, geometry: list[_Geometry]) -> None:
        super().__init__()
        scale = embed_scale(cfg.hidden_size, getattr(cfg, "dtype", None))
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, scale)
        self.layers = nn.ModuleList(Gemma4Layer(cfg, g) for g in geometry)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma4Target(StaticCacheTarget):
    """`vision`: the language model of Gemma4ForConditionalGeneration taking images. Its calls then take
    `vision_embeds` [b, s, H] and `vision_mask` [b, s] (the vision path's rows replace the embedding at
    image tokens), and where the config asks for bidirectional attention over images (31B, 26B) also
    `image_groups` [b, s]: a sliding layer's query at an image token sees every token of the same image,
    ahead of it too (an image's tokens sit in one call: decoding/target_calls.py); 0 at text tokens."""

    batched_prefix = False  # one sequence per call: its attention is not rewritten for in-place batches

    uniform_layers = False  # global layers have other shapes: the export traces every layer

    def __init__(
        self, hf_config, target_layer_ids: list[int], emit_logits: bool = False, placeholders: tuple[int, ...] = ()
    ) -> None:
        """`placeholders`: the image / video token ids of a vision build (none: a text-only target)."""
        self.geometry = [_Geometry(hf_config, i) for i in range(hf_config.num_hidden_layers)]
        super().__init__(hf_config, target_layer_ids, emit_logits)
        vision = bool(placeholders)
        bidirectional = vision and getattr(hf_config, "use_bidirectional_attention", None) == "vision"
        self.extra_inputs = (*VISION_INPUTS, *(("image_groups",) if bidirectional else ())) if vision else ()
        self.placeholders, self.pad_id = tuple(placeholders), int(hf_config.pad_token_id or 0)
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)

    def make_body(self, hf_config) -> nn.Module:
        return _Body(hf_config, self.geometry)

    def rotary_modules(self, hf_config) -> dict[str, Rotary]:
        """`rotary` for the sliding layers, `rotary_full` for the global ones, from Hugging Face's own
        per-kind frequencies (the global kind's are zero past its rotated fraction: those columns keep
        cos 1, sin 0)."""
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

        with torch.device("cpu"):
            hf = Gemma4TextRotaryEmbedding(hf_config)
        return {
            name: Rotary(inv_freq=getattr(hf, f"{kind}_inv_freq"), scaling=getattr(hf, f"{kind}_attention_scaling"))
            for name, kind in ROTARIES.items()
            if any(g.kind == kind for g in self.geometry)  # a reduced model may have window layers only
        }

    def rope(self, position_ids, *extra):
        return {kind: getattr(self, name)(position_ids) for name, kind in ROTARIES.items() if hasattr(self, name)}

    def layer_angles(self, i: int, angles):
        return angles[self.geometry[i].kind]

    def embed(self, input_ids, *extra):
        if not extra:
            return self.model.embed_tokens(input_ids)
        # As Hugging Face's multimodal model: a placeholder token (one the model generated too) embeds as padding
        for token in self.placeholders:
            input_ids = torch.where(input_ids == token, self.pad_id, input_ids)
        x = self.model.embed_tokens(input_ids)
        vision_embeds, vision_mask = extra[:2]
        return torch.where(vision_mask[..., None] > 0.5, vision_embeds.to(x.dtype), x)

    def masks(self, position_ids, slots, *extra):
        visible, windowed = super().masks(position_ids, slots, *extra)
        if "image_groups" not in self.extra_inputs:
            return visible, windowed
        groups = extra[self.extra_inputs.index("image_groups")]  # [b, s]
        # each slot's image group: a slot this call writes takes its row's group; earlier slots 0 (an image
        # never spans calls, so tokens of earlier calls are never in a query's own image)
        writes = (position_ids[:, :, None] == slots[None, None, :]).to(groups.dtype)  # [b, s, C]
        slot_groups = (writes * groups[:, :, None]).sum(1)  # [b, C]
        same = (groups[:, :, None] == slot_groups[:, None, :]) & (groups[:, :, None] > 0)
        for w in windowed:
            near = (slots[None, None, :] > position_ids[:, :, None] - w)[:, None]
            windowed[w] = (visible | same[:, None]) & near
        return visible, windowed

    def text_inputs(self, position_ids: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
        """The neutral extra inputs of a text-only call at `position_ids` [b, s]."""
        b, s = position_ids.shape
        neutral = [torch.zeros(b, s, self.spec.hidden, dtype=dtype), torch.zeros(b, s, dtype=dtype)]
        return neutral + ([torch.zeros(b, s, dtype=torch.long)] if "image_groups" in self.extra_inputs else [])

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(normed)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def empty_cache(self, ctx_len: int, batch: int = 1, dtype=torch.float32) -> list[torch.Tensor]:
        return [torch.zeros((batch, g.kv_heads, ctx_len, g.head_dim), dtype=dtype) for g in self.geometry for _ in "kv"]
