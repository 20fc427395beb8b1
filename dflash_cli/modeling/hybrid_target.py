"""Export-ready Qwen3.5 target (text path): Gated DeltaNet layers between gated full-attention layers.

`config.layer_types` says which layers are "linear_attention" (modeling/delta_rollback.py) and which
"full_attention": q_proj yields the query and a sigmoid output gate per head, q and k are RMS-normalised
per head, rotary covers the first `partial_rotary_factor` of the head (text positions make the
interleaved M-RoPE sections ordinary RoPE), and every RMSNorm scales by (1 + weight).

Cache inputs, in layer order: a full layer's `past_key.i` / `past_value.i` (as StaticCacheTarget's); a
linear layer's `past_conv.i` [b, conv_dim, K-1], `past_recurrent.i` [b, Hv, dk, dv] (the states at the
previous call's start) and `past_delta.i` [b, R, row_width] (its pending rows); last
`past_delta_positions` [b, R]. All are retained state: the next call folds in the pending rows its start
position shows were accepted, so rollback stays implicit, by position, as for the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_cli.families import family_for
from dflash_cli.modeling.delta_rollback import RollbackDeltaLayer, row_plan
from dflash_cli.modeling.gated_delta import squarings_for
from dflash_cli.modeling.layers import (
    Rotary,
    SwiGLU,
    append_cache,
    cache_outputs,
    grouped_attention,
    rms_normalize,
    write_cache,
)
from dflash_cli.modeling.moe import SparseMoe, sparse_layers
from dflash_cli.modeling.row_attention import row_attention
from dflash_cli.modeling.target import _Fusion

LINEAR = "linear_attention"
DELTA_POSITIONS = "past_delta_positions"


@dataclass(frozen=True)
class HybridSpec:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    layer_types: tuple[str, ...]

    @classmethod
    def from_hf(cls, cfg) -> HybridSpec:
        kinds = tuple(cfg.layer_types)
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            intermediate=getattr(cfg, "intermediate_size", 0),  # none in a mixture-of-experts config
            vocab=cfg.vocab_size,
            eps=cfg.rms_norm_eps,
            layer_types=kinds[: cfg.num_hidden_layers],
        )

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_types) if k != LINEAR]


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight): the weights are stored zero-centred."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x.float(), self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] features of each head; the rest pass through."""
    rot = cos.shape[-1]
    head, tail = x[..., :rot], x[..., rot:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = rot // 2
    rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    return torch.cat((head * cos + rotated * sin, tail), dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, cfg, spec: HybridSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, d
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(h, spec.heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, spec.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, spec.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(spec.heads * d, h, bias=bias)
        self.q_norm = OffsetRMSNorm(d, spec.eps)
        self.k_norm = OffsetRMSNorm(d, spec.eps)
        self.prefix_cache = False

    def forward(self, x, cos, sin, positions, visible, past_k, past_v):
        b, s, _ = x.shape
        query, gate = self.q_proj(x).view(b, s, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(query).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if self.prefix_cache:  # ONNX Runtime: each row over the slots it sees (exact at any call length)
            (new_k, keep_k), (new_v, keep_v) = append_cache(past_k, k), append_cache(past_v, v)
            out = row_attention(q, new_k, new_v, positions, self.head_dim**-0.5).transpose(1, 2).reshape(b, s, -1)
        else:
            new_k = keep_k = write_cache(past_k, positions, k)
            new_v = keep_v = write_cache(past_v, positions, v)
            out = grouped_attention(q, new_k, new_v, visible)
        out = out * torch.sigmoid(gate.reshape(b, s, -1))
        return self.o_proj(out), keep_k, keep_v


class HybridLayer(nn.Module):
    def __init__(self, cfg, spec: HybridSpec, kind: str, squarings: int, sparse: bool) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = OffsetRMSNorm(spec.hidden, spec.eps)
        if kind == LINEAR:
            self.linear_attn = RollbackDeltaLayer(cfg, squarings)
        else:
            self.self_attn = GatedAttention(cfg, spec)
        self.post_attention_layernorm = OffsetRMSNorm(spec.hidden, spec.eps)
        if sparse:  # routed experts and a shared one (Qwen3.5-MoE: every layer; Qwen3-Next: by its config)
            self.mlp = SparseMoe.from_hf(cfg)
        else:
            self.mlp = SwiGLU(spec.hidden, spec.intermediate)


class _Body(nn.Module):
    def __init__(self, cfg, spec: HybridSpec, squarings: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        sparse = set(sparse_layers(cfg)) if family_for(cfg.model_type).moe else set()
        self.layers = nn.ModuleList(
            HybridLayer(cfg, spec, k, squarings, i in sparse) for i, k in enumerate(spec.layer_types)
        )
        self.norm = OffsetRMSNorm(spec.hidden, spec.eps)


class HybridCacheTarget(nn.Module):
    """forward(input_ids, position_ids, *past) -> tokens, [logits], context_features, *retained past.

    `longest_call`: the most tokens one call carries (prefill chunk, verify block); the delta rule's
    block inverse is exact up to it. `keep_rows`: pending rows a static graph keeps (the longest verify;
    None in the prefix-cache form, where the host keeps every row of a call)."""

    normed_tap: int | None = None
    prefix_cache = False

    extra_inputs: tuple[str, ...] = ()

    def __init__(
        self,
        hf_config,
        target_layer_ids: list[int],
        emit_logits: bool = False,
        longest_call: int = 64,
        keep_rows=16,
        vision: bool = False,
    ) -> None:
        """`vision`: the language model of Qwen3_5ForConditionalGeneration taking images: its calls also take
        M-RoPE positions and the tower's rows at image tokens (as modeling/vl_target.py, without deepstack)."""
        super().__init__()
        self.spec = HybridSpec.from_hf(hf_config)
        self.layer_ids = list(target_layer_ids)
        self.emit_logits = emit_logits
        self.keep_rows = keep_rows
        self.rotary = Rotary(hf_config)
        self.model = _Body(hf_config, self.spec, squarings_for(longest_call))
        self.lm_head = nn.Linear(self.spec.hidden, self.spec.vocab, bias=False)
        self.dflash = _Fusion(self.spec.hidden, len(self.layer_ids), self.spec.eps)
        if vision:
            self.extra_inputs = ("rope_position_ids", "vision_embeds", "vision_mask")
            self.register_buffer("mrope_axes", None, persistent=False)
            self.computed_buffers(hf_config)

    def computed_buffers(self, hf_config) -> None:
        """Buffers computed from the config, not loaded (again on the CPU after a build on the meta device)."""
        if self.extra_inputs:
            from dflash_cli.modeling.vl_target import mrope_axes_of

            self.mrope_axes = mrope_axes_of(hf_config, self.spec.head_dim)

    def text_inputs(self, position_ids: torch.Tensor, dtype=torch.float32) -> list[torch.Tensor]:
        """The neutral extra inputs of a text-only call at `position_ids` [b, s]."""
        b, s = position_ids.shape
        rope = position_ids[..., None].expand(b, s, 3).clone()
        return [rope, torch.zeros(b, s, self.spec.hidden, dtype=dtype), torch.zeros(b, s, dtype=dtype)]

    def use_prefix_cache(self, on: bool = True) -> None:
        """The ONNX Runtime form: attention layers take the filled slots as StaticCacheTarget.use_prefix_cache
        and attend row by row; linear layers keep every row of a call pending and run the delta rule row by
        row (both exact whatever the call's length)."""
        self.prefix_cache = on
        for layer in self.model.layers:
            if layer.kind != LINEAR:
                layer.self_attn.prefix_cache = on
            else:
                layer.linear_attn.row_by_row = on

    def _rows_kept(self) -> int | None:
        return None if self.prefix_cache else self.keep_rows

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor):
        names = self.io_names()[0][2:]
        state = dict(zip(names, past))
        first_kv = state[f"past_key.{self.spec.attention_layers[0]}"] if self.spec.attention_layers else None
        if first_kv is not None:
            slots_seen = first_kv.shape[1] + input_ids.shape[1] if self.prefix_cache else first_kv.shape[2]
            slots = torch.arange(slots_seen, device=input_ids.device)
            visible = (slots[None, None, :] <= position_ids[:, :, None])[:, None]
        plan = row_plan(position_ids, state[DELTA_POSITIONS], self._rows_kept())
        valid, fresh, commit, fold, pick, kept_positions = plan
        x = self.model.embed_tokens(input_ids)
        if self.extra_inputs:
            from dflash_cli.modeling.vl_target import merge_image_rows, mrope_cos_sin

            cos, sin = mrope_cos_sin(self.rotary, state["rope_position_ids"], self.mrope_axes)
            x = merge_image_rows(x, state["vision_embeds"], state["vision_mask"])
        else:
            cos, sin = self.rotary(position_ids)
        taps, retained = {}, []
        last = self.spec.num_layers - 1 if self.normed_tap is None else self.normed_tap
        for i, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            if layer.kind == LINEAR:
                a, conv, rec, rows = layer.linear_attn.step(
                    h,
                    valid,
                    fresh,
                    commit,
                    fold,
                    pick,
                    state[f"past_conv.{i}"],
                    state[f"past_recurrent.{i}"],
                    state[f"past_delta.{i}"],
                )
                retained += [conv, rec, rows]
            else:
                a, k, v = layer.self_attn(
                    h, cos, sin, position_ids, visible, state[f"past_key.{i}"], state[f"past_value.{i}"]
                )
                retained += [k, v]
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in self.layer_ids and i != last:
                taps[i] = x
        normed = self.model.norm(x)
        taps[last] = normed  # Hugging Face's hidden_states[-1] is taken after the final norm
        context = self.dflash.hidden_norm(self.dflash.fc(torch.cat([taps[i] for i in self.layer_ids], dim=-1)))
        logits = self.lm_head(normed)
        tokens = torch.argmax(logits, dim=-1)
        head = (tokens, logits, context) if self.emit_logits else (tokens, context)
        return (*head, *retained, kept_positions)

    def empty_cache(
        self, ctx_len: int, batch: int = 1, dtype=torch.float32, device=None, rows: int | None = None
    ) -> list[torch.Tensor]:
        """Zeros for every cache input: K/V in `dtype` (a prefix-cache caller passes ctx_len = the filled
        slots), the linear layers' states and `rows` pending rows (default: what the static form keeps; one
        in the prefix form) in float32, the rows' positions -1 (none pending)."""
        spec, out = self.spec, []
        rows = rows or (1 if self.prefix_cache else self.keep_rows)
        kv = (
            (batch, ctx_len, spec.kv_heads, spec.head_dim)
            if self.prefix_cache
            else (batch, spec.kv_heads, ctx_len, spec.head_dim)
        )
        for layer in self.model.layers:
            if layer.kind == LINEAR:
                lin = layer.linear_attn
                out += [
                    torch.zeros(batch, lin.conv_dim, lin.kernel - 1, device=device),
                    torch.zeros(batch, lin.v_heads, lin.dk, lin.dv, device=device),
                    torch.zeros(batch, rows, lin.row_width, device=device),
                ]
            else:
                out += [torch.zeros(kv, dtype=dtype, device=device) for _ in range(2)]
        return [*out, torch.full((batch, rows), -1, dtype=torch.int64, device=device)]

    def io_names(self) -> tuple[list[str], list[str]]:
        cache_in = []
        for i, kind in enumerate(self.spec.layer_types):
            parts = ("conv", "recurrent", "delta") if kind == LINEAR else ("key", "value")
            cache_in += [f"past_{p}.{i}" for p in parts]
        cache_in.append(DELTA_POSITIONS)
        head = ["tokens", "logits", "context_features"] if self.emit_logits else ["tokens", "context_features"]
        ins = ["input_ids", "position_ids", *self.extra_inputs, *cache_in]
        return ins, [*head, *cache_outputs(cache_in, self.prefix_cache)]
