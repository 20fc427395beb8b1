"""Qwen3-Next (Qwen3-Next-80B-A3B, Qwen3-Coder-Next): the layers Qwen3.5-MoE took over, stored otherwise.

Every fourth layer gated full attention, the rest Gated DeltaNet; each MLP routed experts plus a sigmoid-gated
shared one (top-k renormalised where `norm_topk_prob`), dense where `mlp_only_layers` / `decoder_sparse_step`
say; (1 + w) RMSNorms; RoPE on the first `partial_rotary_factor` of each head, plain (Qwen3.5's M-RoPE is the
same for text). What differs is a DeltaNet layer's input projections: two tensors whose rows are grouped per key
head (`in_proj_qkvz`: q, k, then that head's value heads' v and z; `in_proj_ba`: their b, then their a) where
Qwen3.5 stores four, each head after head (`in_proj_qkv`: every q, every k, every v; `in_proj_z`, `_b`, `_a`).
Convert reads the fused tensors as the four (weights.Stack "regroup" row views), so Qwen3.5-MoE's modules
compute this family unchanged; `hf_state` puts them back for the export's check against Hugging Face.
A field config.json leaves out reads as transformers' `Qwen3NextConfig` defaults it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_cli.families.family import Family

LINEAR = "linear_attention"
_FUSED = ("in_proj_qkvz.weight", "in_proj_ba.weight")


@dataclass(frozen=True)
class _Geometry:
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    linear_layers: tuple[int, ...]

    @property
    def per_k(self) -> int:  # value heads per key head
        return self.v_heads // self.k_heads


def _geometry(cfg: Any) -> _Geometry:
    """The DeltaNet shapes of a config.json dict (absent fields: Qwen3NextConfig's defaults) or a config object."""
    from dflash_cli.errors import CheckpointError

    if isinstance(cfg, dict):
        from transformers import Qwen3NextConfig

        cfg = Qwen3NextConfig.from_dict(cfg)
    geo = _Geometry(
        int(cfg.linear_num_key_heads),
        int(cfg.linear_num_value_heads),
        int(cfg.linear_key_head_dim),
        int(cfg.linear_value_head_dim),
        tuple(i for i, kind in enumerate(cfg.layer_types[: cfg.num_hidden_layers]) if kind == LINEAR),
    )
    if geo.v_heads % geo.k_heads:
        raise CheckpointError(
            f"linear_num_value_heads {geo.v_heads} is not a multiple of linear_num_key_heads {geo.k_heads}",
            hint="the target's config.json is not a Qwen3-Next one",
        )
    return geo


def _spans(geo: _Geometry) -> dict[str, tuple[str, tuple[tuple[int, int], ...]]]:
    """Qwen3.5's projection -> (the fused tensor it reads, its rows within each key head's group)."""
    dk, vz, r = geo.dk, geo.per_k * geo.dv, geo.per_k
    qkvz, ba = _FUSED
    return {
        "in_proj_qkv.weight": (qkvz, ((0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + vz))),  # all q, all k, all v
        "in_proj_z.weight": (qkvz, ((2 * dk + vz, 2 * dk + 2 * vz),)),
        "in_proj_b.weight": (ba, ((0, r),)),
        "in_proj_a.weight": (ba, ((r, 2 * r),)),
    }


def delta_views(cfg: dict[str, Any], store: Any) -> dict[str, Any]:
    """Each DeltaNet layer's four Qwen3.5 projections as row views of its two fused tensors (by name)."""
    from dflash_cli.checkpoints.weights import Stack
    from dflash_cli.errors import CheckpointError

    geo = _geometry(cfg)
    rows = {
        _FUSED[0]: geo.k_heads * (2 * geo.dk + 2 * geo.per_k * geo.dv),
        _FUSED[1]: 2 * geo.v_heads,
    }
    out = {}
    for layer in geo.linear_layers:
        prefix = f"model.layers.{layer}.linear_attn."
        for fused, n in rows.items():
            name = prefix + fused
            if name not in store or store.shape(name)[0] != n:
                got = f"shape {list(store.shape(name))}" if name in store else "none"
                raise CheckpointError(
                    f"target layer {layer} has no {fused.removesuffix('.weight')} of {n} rows ({name}: {got})",
                    hint="the checkpoint is incomplete or its config.json does not match it",
                )
        for ours, (fused, spans) in _spans(geo).items():
            out[prefix + ours] = Stack((prefix + fused,), geo.k_heads, "regroup", spans)
    return out


def fused_state(state: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """`state` with each DeltaNet layer's four projections fused back per key head, as the checkpoint had them."""
    import torch

    geo = _geometry(cfg)
    out = dict(state)
    for layer in geo.linear_layers:
        prefix = f"model.layers.{layer}.linear_attn."
        if prefix + "in_proj_qkv.weight" not in out:
            continue
        for fused in _FUSED:
            parts = [(ours, spans) for ours, (f, spans) in _spans(geo).items() if f == fused]
            groups = []
            for ours, spans in parts:  # each of ours: for each span, every group's rows in turn
                w = out.pop(prefix + ours)
                at = 0
                for start, stop in spans:
                    n = stop - start
                    groups.append(w[at : at + geo.k_heads * n].reshape(geo.k_heads, n, w.shape[-1]))
                    at += geo.k_heads * n
            # the spans of one fused tensor tile its group in order, so the groups side by side are its rows
            out[prefix + fused] = torch.cat(groups, dim=1).reshape(-1, groups[0].shape[-1])
    return out


FAMILY = Family(
    "qwen3_next",
    qk_norm=True,
    default_mask_token_id=151669,  # Qwen3's vocabulary, and the Qwen3 drafts' mask token
    hybrid=True,
    moe=True,
    checkpoint_views=delta_views,
    hf_state=fused_state,
    tool_call_format="qwen3_xml",
)
