"""Export-ready target (Qwen3 / Llama): static KV cache, a token per position, fused context features.

Module names mirror Hugging Face keys (`model.layers.N.self_attn.q_proj.weight`, ...), plus the
injected `dflash.fc.weight` / `dflash.hidden_norm.weight`, so an injected checkpoint loads strictly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_cli.families import family_for
from dflash_cli.modeling.layers import (
    RMSNorm,
    Rotary,
    SwiGLU,
    append_cache,
    apply_rope,
    cache_outputs,
    grouped_attention,
    write_cache,
)
from dflash_cli.modeling.slot_cache import SlotRows, read_rows


@dataclass(frozen=True)
class TargetSpec:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    qk_norm: bool
    attention_bias: bool
    mlp_bias: bool
    # mixture of experts (modeling/moe.py): the layers with a sparse MLP, experts, chosen per token, width
    sparse_layers: tuple[int, ...] = ()
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    renormalize: bool = True
    # gpt-oss: attention sinks, per-layer windows (None: full attention), its own experts
    sinks: bool = False
    windows: tuple[int | None, ...] = ()
    expert_act: tuple[float, float] = (1.0, float("inf"))  # gated activation's alpha, limit (gpt-oss)

    @classmethod
    def from_hf(cls, cfg) -> TargetSpec:
        fam = family_for(cfg.model_type)
        # Gemma 4 varies the attention geometry by layer: the spec holds layer 0's (gemma4_target.py has each)
        geo = cfg.per_layer_config[0] if fam.per_layer_geometry else cfg
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=cfg.num_attention_heads,
            kv_heads=geo.num_key_value_heads or cfg.num_attention_heads,
            head_dim=getattr(geo, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            eps=cfg.rms_norm_eps,
            qk_norm=fam.qk_norm,
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            sinks=fam.attention_sinks,
            **(_moe_fields(cfg, fam.fused_experts) if fam.moe else {}),
            **(_window_fields(cfg) if fam.sliding else {}),
        )


def _moe_fields(cfg, fused: bool) -> dict:
    """`fused`: gpt-oss's experts (Family.fused_experts): intermediate_size wide, always renormalised, clamped."""
    from dflash_cli.modeling.moe import num_experts, sparse_layers

    return {
        "sparse_layers": tuple(sparse_layers(cfg)),
        "experts": num_experts(cfg),
        "top_k": cfg.num_experts_per_tok,
        "expert_intermediate": cfg.intermediate_size if fused else cfg.moe_intermediate_size,
        "renormalize": True if fused else bool(cfg.norm_topk_prob),
        **({"expert_act": (cfg.swiglu_alpha, cfg.swiglu_limit)} if fused else {}),
    }


def _window_fields(cfg) -> dict:
    kinds = list(getattr(cfg, "layer_types", None) or [])[: cfg.num_hidden_layers]
    return {"windows": tuple(cfg.sliding_window if k == "sliding_attention" else None for k in kinds)}


class TargetAttention(nn.Module):
    def __init__(self, spec: TargetSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, d
        self.q_proj = nn.Linear(h, spec.heads * d, bias=spec.attention_bias)
        self.k_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.attention_bias)
        self.v_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.attention_bias)
        self.o_proj = nn.Linear(spec.heads * d, h, bias=spec.attention_bias)
        self.q_norm = RMSNorm(d, spec.eps) if spec.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, spec.eps) if spec.qk_norm else nn.Identity()
        if spec.sinks:  # gpt-oss: a learnt logit per head that takes part of the softmax and no value
            self.sinks = nn.Parameter(torch.empty(spec.heads))
        self.prefix_cache = False  # see StaticCacheTarget.use_prefix_cache

    def forward(self, x, cos, sin, positions, visible, past_k, past_v):
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sinks = getattr(self, "sinks", None)
        if self.prefix_cache:
            (new_k, keep_k), (new_v, keep_v) = append_cache(past_k, k), append_cache(past_v, v)
            return self.o_proj(grouped_attention(q, new_k, new_v, visible, sinks)), keep_k, keep_v
        new_k = write_cache(past_k, positions, k)
        new_v = write_cache(past_v, positions, v)
        out = grouped_attention(
            q, read_rows(new_k, positions), read_rows(new_v, positions), visible, sinks, any_rows=True
        )
        return self.o_proj(out), new_k, new_v


class TargetLayer(nn.Module):
    def __init__(self, spec: TargetSpec, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.self_attn = TargetAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)
        if index in spec.sparse_layers and spec.sinks:
            from dflash_cli.modeling.moe import GptOssMoe

            self.mlp = GptOssMoe(spec.hidden, spec.expert_intermediate, spec.experts, spec.top_k, *spec.expert_act)
        elif index in spec.sparse_layers:
            from dflash_cli.modeling.moe import SparseMoe

            self.mlp = SparseMoe(spec.hidden, spec.expert_intermediate, spec.experts, spec.top_k, spec.renormalize)
        else:
            self.mlp = SwiGLU(spec.hidden, spec.intermediate, spec.mlp_bias)

    def forward(self, x, cos, sin, positions, visible, past_k, past_v):
        a, k, v = self.self_attn(self.input_layernorm(x), cos, sin, positions, visible, past_k, past_v)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class _Body(nn.Module):
    def __init__(self, spec: TargetSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(TargetLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)


class _Fusion(nn.Module):
    def __init__(self, hidden: int, n_features: int, eps: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)


class StaticCacheTarget(nn.Module):
    """forward(input_ids, position_ids, *past) -> tokens, [logits], context_features, *retained past.

    `past` is [past_key.0, past_value.0, past_key.1, ...], each [b, kv_heads, ctx_len, head_dim].
    Cache slot j is visible to a query at position p iff j <= p, so slots left by a rejected block
    are simply overwritten by the next block: no explicit rollback.
    """

    def __init__(self, hf_config, target_layer_ids: list[int], emit_logits: bool = False) -> None:
        super().__init__()
        self.spec = TargetSpec.from_hf(hf_config)
        self.layer_ids = list(target_layer_ids)
        self.emit_logits = emit_logits
        for name, rotary in self.rotary_modules(hf_config).items():
            setattr(self, name, rotary)
        self.model = self.make_body(hf_config)
        self.lm_head = nn.Linear(self.spec.hidden, self.spec.vocab, bias=False)
        self.dflash = _Fusion(self.spec.hidden, len(self.layer_ids), self.spec.eps)

    prefix_cache = False
    # Its prefix graph takes several sequences per call (continuous batching; exporting/graphs.py)
    batched_prefix = True
    # Every layer of one geometry, so the export may trace one and grow the rest (exporting/replicate.py).
    uniform_layers = True
    # Which id in layer_ids means "after the final norm" (None: the last layer). The export traces a
    # one-layer stand-in whose raw layer-0 output stands for every other tap (exporting/replicate.py),
    # so there the final-norm tap needs an id of its own (-1).
    normed_tap: int | None = None

    def use_prefix_cache(self, on: bool = True) -> None:
        """The ONNX Runtime form: `past` [b, L, kvh, d] holds only the L slots filled before the call (L is
        symbolic), and the graph returns the call's own K/V as `present_*` [b, s, kvh, d] instead of a whole
        new cache; the host stores them. A call then costs in proportion to the filled length, not ctx_len,
        and nothing copies the cache. The static form stays what accelerators get."""
        self.prefix_cache = on
        for layer in self.model.layers:
            layer.self_attn.prefix_cache = on

    # Inputs between position_ids and the caches (a vision-language target's, modeling/vl_target.py).
    extra_inputs: tuple[str, ...] = ()
    # Continuous batching on an accelerator (modeling/slot_cache.py): a `batch_index` input [b, 1] right after
    # position_ids, and caches of this many sequences. 0: the one-sequence graph.
    full_batch_size = 0

    def use_batch_index(self, full_batch_size: int) -> None:
        self.full_batch_size = full_batch_size

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *rest: torch.Tensor):
        where = position_ids  # where each row's K/V go: its positions, or its slot's positions
        if self.full_batch_size:
            where, rest = SlotRows(rest[0].reshape(-1), position_ids), rest[1:]
        extra, past = rest[: len(self.extra_inputs)], rest[len(self.extra_inputs) :]
        slots_seen = past[0].shape[1] + input_ids.shape[1] if self.prefix_cache else past[0].shape[2]
        angles = self.rope(position_ids, *extra)
        slots = torch.arange(slots_seen, device=input_ids.device)
        visible, windowed = self.masks(position_ids, slots, *extra)
        x = self.embed(input_ids, *extra)
        taps, retained = {}, []
        last = self.spec.num_layers - 1 if self.normed_tap is None else self.normed_tap
        for i, layer in enumerate(self.model.layers):
            seen = windowed[self.spec.windows[i]] if self.spec.windows and self.spec.windows[i] else visible
            x, k, v = layer(x, *self.layer_angles(i, angles), where, seen, past[2 * i], past[2 * i + 1])
            retained += [k, v]
            if i in self.layer_ids and i != last:
                taps[i] = x
            x = self.after_layer(i, x, *extra)
        normed = self.model.norm(x)
        # The feature of layer i is Hugging Face's hidden_states[i + 1]; for the last layer that entry
        # is taken after the final norm, and drafts are trained on exactly that.
        taps[last] = normed
        context = self.dflash.hidden_norm(self.dflash.fc(torch.cat([taps[i] for i in self.layer_ids], dim=-1)))
        logits = self.head(normed)
        tokens = torch.argmax(logits, dim=-1)
        head = (tokens, logits, context) if self.emit_logits else (tokens, context)
        return (*head, *retained)

    def masks(self, position_ids: torch.Tensor, slots: torch.Tensor, *extra: torch.Tensor):
        """(what a full-attention layer's queries see [b, 1, s, C], {window: what a sliding layer's see})."""
        visible = (slots[None, None, :] <= position_ids[:, :, None])[:, None]
        # A sliding-window layer sees only the last `window` positions (gpt-oss); its cache still has every slot.
        # `visible` first: replication finds the full mask as the first input of the window mask's And.
        windowed = {
            w: visible & (slots[None, None, :] > position_ids[:, :, None] - w)[:, None]
            for w in set(self.spec.windows) - {None}
        }
        return visible, windowed

    def make_body(self, hf_config) -> nn.Module:
        return _Body(self.spec)

    def rotary_modules(self, hf_config) -> dict[str, Rotary]:
        """The RoPE modules by attribute name: computed from the config, never loaded."""
        return {"rotary": Rotary(hf_config)}

    def rope(self, position_ids: torch.Tensor, *extra: torch.Tensor):
        return self.rotary(position_ids)

    def layer_angles(self, i: int, angles):
        """Layer i's (cos, sin) out of what `rope` returned (one pair for every layer here)."""
        return angles

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        return self.lm_head(normed)

    def embed(self, input_ids: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def after_layer(self, i: int, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return x

    def empty_cache(self, ctx_len: int, batch: int = 1, dtype=torch.float32) -> list[torch.Tensor]:
        shape = (batch, self.spec.kv_heads, ctx_len, self.spec.head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * self.spec.num_layers)]

    def io_names(self) -> tuple[list[str], list[str]]:
        cache_in = [f"past_{kv}.{i}" for i in range(self.spec.num_layers) for kv in ("key", "value")]
        head = ["tokens", "logits", "context_features"] if self.emit_logits else ["tokens", "context_features"]
        slots = ["batch_index"] if self.full_batch_size else []
        ins = ["input_ids", "position_ids", *slots, *self.extra_inputs, *cache_in]
        return ins, [*head, *cache_outputs(cache_in, self.prefix_cache)]
