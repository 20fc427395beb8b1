"""The DFlash draft (z-lab checkpoint layout), shared by training, the PyTorch reference and export.

Parameter names are the z-lab keys (`layers.N.self_attn.q_proj.weight`, `fc.weight`,
`hidden_norm.weight`, `norm.weight`) plus the injected `embed_tokens.weight` / `lm_head.weight`.
Queries come only from the block; keys/values are [context ; block], the context projected by each
layer's own k_proj/v_proj (then k_norm) at the context tokens' positions; no causal mask.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dflash_cli.modeling.layers import (
    RMSNorm,
    Rotary,
    ScaledEmbedding,
    SwiGLU,
    append_cache,
    apply_rope,
    cache_outputs,
    grouped_attention,
    write_cache,
)
from dflash_cli.modeling.slot_cache import SlotRows, read_rows


class DraftAttention(nn.Module):
    any_rows = False  # set in a slot-cache graph (use_batch_index): see grouped_attention

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _kv(self, x, cos, sin):
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped K and V [b, kvh, c, d] of fused context features at their positions."""
        return self._kv(ctx, cos, sin)

    def forward(self, x, cos, sin, ctx_k, ctx_v, visible):
        """x: normed block hidden [b, q, H]; ctx_k/ctx_v [b, kvh, c, d]; visible [b, 1, q, c+q]."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self._kv(x, cos, sin)
        out = grouped_attention(
            q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), visible, any_rows=self.any_rows
        )
        return self.o_proj(out)


class DraftLayer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, intermediate, eps, dflash2=None, block=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = DraftAttention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)
        if dflash2 is not None:  # DFlash2: a convolution along the block around each sublayer (dflash2.py)
            from dflash_cli.modeling.dflash2 import GroupedConv

            self.attention_conv = GroupedConv(hidden, dflash2, block)
            self.mlp_conv = GroupedConv(hidden, dflash2, block)
        self.dflash2 = dflash2 is not None

    def forward(self, x, cos, sin, ctx_k, ctx_v, visible):
        if not self.dflash2:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, visible)
            return x + self.mlp(self.post_attention_layernorm(x))
        a, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(a, cos, sin, ctx_k, ctx_v, visible), delta)
        m, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(m), delta)


class DFlashDraft(nn.Module):
    def __init__(self, hf_config, n_target_features: int, vocab_size: int) -> None:
        super().__init__()
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv = c.num_key_value_heads or c.num_attention_heads
        self.hidden, self.kv_heads, self.head_dim = c.hidden_size, kv, head_dim
        spec = getattr(c, "dflash2", None)  # a Dflash2Spec (loading.draft_config), None for a DFlash draft
        block = getattr(c, "block_size", None)
        self.layers = nn.ModuleList(
            DraftLayer(
                c.hidden_size, c.num_attention_heads, kv, head_dim, c.intermediate_size, c.rms_norm_eps, spec, block
            )
            for _ in range(c.num_hidden_layers)
        )
        if spec is not None:
            from dflash_cli.modeling.dflash2 import CandidateSelector

            self.candidate_selector = CandidateSelector(c.hidden_size, vocab_size, spec)
        self.dflash2 = spec is not None
        self.fc = nn.Linear(n_target_features * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # injected from the target; Gemma 4's is scaled by sqrt(hidden) (convert writes embed_scale)
        self.embed_tokens = ScaledEmbedding(vocab_size, c.hidden_size, float(getattr(c, "embed_scale", None) or 1.0))
        self.lm_head = nn.Linear(c.hidden_size, vocab_size, bias=False)  # injected from the target
        self.rotary = Rotary(c)

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """[b, c, n*H] concatenated target features -> fused context [b, c, H]."""
        return self.hidden_norm(self.fc(target_features))

    def hidden_states(self, block_ids, block_pos, ctx_kv_per_layer, visible) -> torch.Tensor:
        """Final-normed hidden states of the block; ctx_kv_per_layer: [(k, v)] per layer."""
        cos, sin = self.rotary(block_pos)
        x = self.embed_tokens(block_ids)
        for layer, (ck, cv) in zip(self.layers, ctx_kv_per_layer):
            x = layer(x, cos, sin, ck, cv, visible)
        return self.norm(x)

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cos, sin = self.rotary(ctx_pos)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_ids, block_pos, ctx, ctx_pos, visible) -> torch.Tensor:
        """Logits of every block position given fused context (training and the eager reference)."""
        return self.lm_head(self.hidden_states(block_ids, block_pos, self.context_kv(ctx, ctx_pos), visible))

    def propose(self, block_ids, h, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logits) proposed for the block's positions after its first, from its final hidden states:
        each position's argmax, or a DFlash2 draft's selector walk from the block's first token. `rows` (a
        DFlash draft's prefix graph): only the first rows.shape[1] proposals, the rest never reach the head."""
        if rows is not None:  # a gather, not a slice: the rows' count stays unrelated to the block's length
            h = h.index_select(1, torch.arange(rows.shape[1] + 1, device=h.device))
        logits = self.lm_head(h[:, 1:])
        if not self.dflash2:
            return torch.argmax(logits, dim=-1), logits
        return self.candidate_selector.propose(h[:, 1:], logits, block_ids[:, 0]), logits


def proposal_confidence(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[b, B-1]: the draft's probability of each token it proposes (what the decoding loop weighs a position's
    chance of acceptance by, decoding/verify_length.py). Written to stay finite in fp16 and on the QAIC op list
    (TopK, Exp, ReduceMean; not ReduceLogSumExp or ReduceSum): (exp(chosen - max) / sqrt(V)) / (mean(exp(logits -
    max)) * sqrt(V)), where no factor exceeds sqrt(V) (ONNX Runtime's fp16 Softmax overflowed to NaN in the fp16
    emulation; and V itself, 151936 for Qwen3, is no fp16 number: a card's fp16 conversion makes it inf)."""
    if logits.dtype != torch.float32:  # a no-op cast trips the exporter (modeling/dflash2.py's _f32)
        logits = logits.float()
    top = torch.topk(logits, 1, dim=-1).values
    chosen = torch.gather(logits, -1, tokens[..., None])
    root = math.sqrt(logits.shape[-1])
    share = torch.exp(chosen - top) / root
    return (share / (torch.exp(logits - top).mean(dim=-1, keepdim=True) * root)).squeeze(-1)


class StaticCacheDraft(nn.Module):
    """Export wrapper: forward(input_ids, position_ids, context_features, context_position_ids, *past).

    New context K/V are scattered into the cache at their positions; the block's own K/V are used
    for this call only and never stored, which is exactly the reference's crop-to-committed cache.
    Cache slot j is visible iff j < the block's first position.
    """

    prefix_cache = False  # see StaticCacheTarget.use_prefix_cache
    batched_prefix = True  # its prefix graph takes several sequences per call (continuous batching)

    def __init__(self, draft: DFlashDraft, emit_logits: bool = False) -> None:
        super().__init__()
        self.draft = draft
        self.emit_logits = emit_logits

    def use_prefix_cache(self, on: bool = True) -> None:
        self.prefix_cache = on

    @property
    def any_block_rows(self) -> bool:
        """Whether the block may be of any length (not a DFlash2 draft, whose convolutions span a fixed block)."""
        return not self.draft.dflash2

    @property
    def takes_proposal_rows(self) -> bool:
        """Whether the graph takes `proposal_rows` (a DFlash draft's one-sequence-per-slot prefix graph): only its
        axis 1 is read, the number of proposals that go through the vocabulary head (the decoding loop asks for
        as many as it may verify; at a 151936-row head that is much of a draft call's cost)."""
        return self.prefix_cache and self.any_block_rows and not self.full_batch_size

    full_batch_size = 0  # as StaticCacheTarget's: `batch_index` after context_position_ids, caches of that many

    def use_batch_index(self, full_batch_size: int) -> None:
        self.full_batch_size = full_batch_size
        for layer in self.draft.layers:
            layer.self_attn.any_rows = bool(full_batch_size)

    def forward(self, input_ids, position_ids, context_features, context_position_ids, *past):
        d = self.draft
        where = context_position_ids
        if self.full_batch_size:
            where, past = SlotRows(past[0].reshape(-1), context_position_ids), past[1:]
        rows = None
        if self.takes_proposal_rows:
            rows, past = past[0], past[1:]
        new_kv = d.context_kv(context_features, context_position_ids)
        retained, per_layer = [], []
        for i, (k, v) in enumerate(new_kv):
            if self.prefix_cache:
                (ck, keep_k), (cv, keep_v) = append_cache(past[2 * i], k), append_cache(past[2 * i + 1], v)
                retained += [keep_k, keep_v]
            else:
                ck = write_cache(past[2 * i], where, k)
                cv = write_cache(past[2 * i + 1], where, v)
                retained += [ck, cv]
                ck, cv = read_rows(ck, where), read_rows(cv, where)
            per_layer.append((ck, cv))
        if self.prefix_cache:
            cache_visible = self._prefix_visible(past[0], context_position_ids)
        else:
            slots = torch.arange(ck.shape[2], device=input_ids.device)
            start = position_ids[:, :1]  # [b, 1]
            cache_visible = slots[None, :] < start
        cache_visible = cache_visible[:, None, :].expand(-1, input_ids.shape[1], -1)
        block_visible = torch.ones_like(cache_visible[..., : input_ids.shape[1]])
        visible = torch.cat([cache_visible, block_visible], dim=-1)[:, None]
        h = d.hidden_states(input_ids, position_ids, per_layer, visible)
        tokens, logits = d.propose(input_ids, h, rows)
        confidence = proposal_confidence(logits, tokens)
        return (tokens, confidence, logits, *retained) if self.emit_logits else (tokens, confidence, *retained)

    @staticmethod
    def _prefix_visible(past: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor:
        """[b, L + c]: which of [past ; this call's context] the block sees. Row r of a batched call has
        filled only its first ctx_pos[r, 0] slots of the L it is handed (sequences of different lengths
        share the call), and its context rows at position -1 are padding. Alone in a call (L filled, the
        context catching up to the block) this is the static form's `slot < block start`."""
        slots = torch.arange(past.shape[1], device=ctx_pos.device)
        filled = slots[None, :] < ctx_pos[:, :1]
        return torch.cat([filled, ctx_pos >= 0], dim=1)

    def empty_cache(self, ctx_len: int, batch: int = 1, dtype=torch.float32) -> list[torch.Tensor]:
        shape = (batch, self.draft.kv_heads, ctx_len, self.draft.head_dim)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * len(self.draft.layers))]

    def io_names(self) -> tuple[list[str], list[str]]:
        cache_in = [f"past_{kv}.{i}" for i in range(len(self.draft.layers)) for kv in ("key", "value")]
        head = ["draft_tokens", "draft_confidence", *(["draft_logits"] if self.emit_logits else [])]
        slots = ["batch_index"] if self.full_batch_size else []
        slots += ["proposal_rows"] if self.takes_proposal_rows else []  # exporting.names.PROPOSAL_ROWS
        inputs = ["input_ids", "position_ids", "context_features", "context_position_ids", *slots, *cache_in]
        return inputs, [*head, *cache_outputs(cache_in, self.prefix_cache)]
