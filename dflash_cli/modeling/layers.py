"""Building blocks shared by the export-ready target and the DFlash draft.

Written for export: explicit matmuls, finite-minimum masking, no data-dependent control flow.
"""

from __future__ import annotations

import torch
from torch import nn

# RMSNorm in two passes so it stays finite when a compiler runs it in fp16 (QAIC's -convert-to-fp16):
# x^2 overflows fp16 for |x| > 256, and real residual streams carry outliers of 1e3-1e4. The coarse
# pass squares x / COARSE (finite for any fp16 x) to estimate the RMS; the exact pass squares
# x / estimate, which is ~1 whatever the RMS. The floor keeps the estimate positive when the coarse
# mean underflows (RMS below ~0.06), so the estimate is never below COARSE * sqrt(floor) = 1/16.
_NORM_COARSE = 256.0
_NORM_FLOOR = 2.0**-24  # fp16's smallest subnormal


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, in x's dtype, without fp16 overflow or underflow.

    Mathematically identical to the one-pass form: with s the coarse RMS estimate,
    (x/s) / sqrt(mean((x/s)^2) + eps/s^2) = x / sqrt(mean(x^2) + eps).
    """
    coarse = x * (1.0 / _NORM_COARSE)
    mean_sq = coarse.pow(2).mean(-1, keepdim=True)
    # Where with a scalar, not clamp (Clip is not on the QAIC op allow-list) nor a full-size constant.
    scale = torch.sqrt(torch.where(mean_sq > _NORM_FLOOR, mean_sq, _NORM_FLOOR)) * _NORM_COARSE  # ~RMS
    y = x / scale  # ~unit RMS; divides x itself, as x / COARSE loses small values to fp16 subnormals
    # eps / s^2 as (sqrt(eps) / s)^2: every factor stays a normal fp16 number; it underflows harmlessly when s is large.
    eps_scaled = (eps**0.5 / scale).pow(2)
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps_scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x.float(), self.eps).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose rows are multiplied by `scale` (Gemma 4: sqrt(hidden)). The product happens inside
    the embedding module, so an exported graph's layers start where the scaled rows leave it (replicate.py)."""

    def __init__(self, num: int, dim: int, scale: float = 1.0) -> None:
        super().__init__(num, dim)
        self.scale = float(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        return x if self.scale == 1.0 else x * torch.tensor(self.scale, dtype=x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """RoPE tables from the Hugging Face config, so every rope type (llama3 scaling...) matches HF."""

    def __init__(self, hf_config=None, *, inv_freq: torch.Tensor | None = None, scaling: float = 1.0) -> None:
        """From a config, or from given frequencies (a family with a rotary per layer kind, gemma4_target.py)."""
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if inv_freq is not None:
            pass
        elif rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            dim = int(dim * params.get("partial_rotary_factor", 1.0))  # Qwen3.5 rotates a quarter of the head
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)
        self.register_buffer("cos_table", None, persistent=False)
        self.register_buffer("sin_table", None, persistent=False)

    def tables(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..max_positions-1, [max_positions, head_dim], computed in float32."""
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def use_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Look angles up instead of computing them: an exported graph then holds cos/sin values (within
        +-1, exact to ~5e-4 in fp16) rather than the angle position x inv_freq, which a compiler's fp16
        conversion rounds to whole radians past position ~2048 (QAIC's -convert-to-fp16)."""
        self.cos_table, self.sin_table = cos, sin

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [b, 1, s, head_dim] for integer positions [b, s]."""
        # Padding (-1) takes position 0: its outputs are never read. (Where, not clamp: Clip is not on
        # the QAIC op allow-list.)
        positions = torch.where(positions < 0, torch.zeros_like(positions), positions)
        if self.cos_table is not None:
            return self.cos_table[positions][:, None], self.sin_table[positions][:, None]
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Angles are computed in float32 (fp16 angles lose whole positions); the rotation runs in x's dtype.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# fp16's most negative finite value. float32's minimum (-3.4e38) becomes -inf when a compiler converts
# the graph to fp16 (QAIC's -convert-to-fp16), and a fully masked padding row then turns into NaN;
# this value stays finite in fp16, bf16 and fp32, and exp() of it is 0 in all three.
MASKED_SCORE = -65504.0


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    any_rows: bool = False,
) -> torch.Tensor:
    """Attention with grouped KV heads, without materialising repeated K/V.

    q [b, h, s, d]; k, v [b, kvh, t, d]; visible bool [b, 1, s, t]. Returns [b, s, h*d].
    Masked scores are MASKED_SCORE (not -inf) so fully masked padding rows stay finite.
    Cache slots no query can see are zeroed in V: on an accelerator the retained cache starts as
    whatever the device buffer held (QEfficient never feeds it zeros), and a weight of 0 times a
    NaN left there is still NaN. Masked K needs nothing: the Where on the scores discards it.
    `any_rows` reshapes the query rows with -1: a slot-cache graph's ("_cb") shapes then infer static
    per specialization; a prefix graph keeps the product, which torch.onnx's re-trace spells the same way
    (tests/test_no_retrace.py).
    """
    b, h, s, d = q.shape
    kvh, t = k.shape[1], k.shape[2]
    groups = h // kvh
    rows = -1 if any_rows else groups * s
    # contiguous: reshaping a strided q (gpt-oss's) spells -1 out as a quotient, which shape inference cannot resolve
    qg = (q.contiguous() if any_rows else q).reshape(b, kvh, rows, d)
    # `scale`: Gemma 4 normalises q and k and scales by 1, where others use 1/sqrt(d)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)  # [b, kvh, groups*s, t]
    scores = scores.reshape(b, kvh, groups, s, t)
    mask = visible[:, :, None]  # [b, 1, 1, s, t]
    scores = torch.where(mask, scores, MASKED_SCORE)  # a scalar: no full-size constant per call
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).reshape(b, kvh, rows, t)
    else:  # gpt-oss: one more logit per head in the softmax, whose share of attention goes nowhere
        sink = sinks.to(scores.dtype).reshape(1, kvh, groups, 1, 1).expand(b, kvh, groups, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :t]
        probs = (probs.contiguous() if any_rows else probs).reshape(b, kvh, rows, t)
    # A slot is live when some query sees it (mean, not any/max: ReduceMax is not on the QAIC allow-list).
    live = (visible.to(probs.dtype).mean(dim=2) > 0)[..., None]  # [b, 1, t, 1]
    v = torch.where(live, v, 0.0)
    out = torch.matmul(probs, v).reshape(b, h, s, d)
    return out.transpose(1, 2).reshape(b, s, h * d)


def write_cache(cache: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Scatter new K or V [b, kvh, s, d] into cache [b, kvh, C, d] at `positions` [b, s].

    Negative positions (padding) go to the spare last slot C-1, which no live query ever sees:
    ONNX scatter ops would wrap -1 to that slot anyway, but we make it explicit so no backend's
    treatment of negative indices matters. `positions` may be a slot_cache.SlotRows (a graph whose cache holds
    several sequences): the rows are then written into their own slots.
    """
    slots = None if isinstance(positions, torch.Tensor) else positions
    if slots is not None:
        positions = slots.positions
    spare = cache.shape[2] - 1
    idx = torch.where(positions < 0, torch.full_like(positions, spare), positions)
    if slots is not None:
        from dflash_cli.modeling.slot_cache import scatter_slots

        return scatter_slots(cache, slots.rows, idx, new)
    idx = idx[:, None, :, None].expand(new.shape[0], new.shape[1], new.shape[2], new.shape[3])
    return cache.scatter(2, idx, new)


def append_cache(past: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix-cache form (ONNX Runtime): `past` [b, L, kvh, d] holds only the L filled slots,
    slot-major so the host can hand over a prefix of its buffer without a copy; `new` [b, kvh, s, d].

    Returns (K or V to attend to [b, kvh, L+s, d], what the host stores at the call's positions
    [b, s, kvh, d]). Slot L+t is the call's row t: visible by the same `slot <= position` rule as
    the static cache, since real rows of a call sit at positions L, L+1, ... and padding after them.
    """
    return torch.cat([past.transpose(1, 2), new], dim=2), new.transpose(1, 2)


def cache_outputs(cache_in: list[str], prefix_cache: bool) -> list[str]:
    """past_key.0 -> past_key.0_RetainedState (static cache) or present_key.0 (prefix cache)."""
    if prefix_cache:
        return [n.replace("past_", "present_", 1) for n in cache_in]
    return [f"{n}_RetainedState" for n in cache_in]
