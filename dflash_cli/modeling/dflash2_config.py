"""What a DFlash2 draft's config.json says beyond a DFlash draft's, and the tensors it adds (no torch: convert
reads this). The modules are in dflash2.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_cli.errors import CheckpointError, RecipeError

ARCHITECTURE = "DFlash2DraftModel"
# dflash_config fields a DFlash2 draft may carry, and whether they change what we compute
_FIELDS = {
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
}
# fields of the plain DFlash draft that every draft's dflash_config may carry
_DFLASH_FIELDS = {"mask_token_id", "target_layer_ids", "block_size", "causal"}


@dataclass(frozen=True)
class Dflash2Spec:
    taps: int
    group_size: int
    rank: int
    top_k: int
    output_multiplier: float = 1.0
    softcap: float | None = None


def is_dflash2(cfg: dict[str, Any]) -> bool:
    """A DFlash2 draft: named so, or carrying the selector or convolution of one."""
    archs = cfg.get("architectures") or []
    dfc = cfg.get("dflash_config") or {}
    return ARCHITECTURE in archs or any(dfc.get(k) for k in ("selector_rank", "conv_kernel_size"))


def spec_of(cfg: dict[str, Any], where: str = "draft config") -> Dflash2Spec | None:
    """The DFlash2 parts of a draft's config.json, None for a plain DFlash draft; a DFlash2 draft missing a
    part, or carrying a field we do not compute, is refused (run as plain DFlash it would propose other tokens)."""
    if not is_dflash2(cfg):
        return None
    dfc = cfg.get("dflash_config") or {}
    unknown = sorted(set(dfc) - _FIELDS - _DFLASH_FIELDS)
    if unknown:
        raise CheckpointError(
            f"DFlash2 draft's dflash_config has {', '.join(unknown)}, which dflash does not compute: {where}",
            hint="this draft variant is not supported yet; use a DFlash or DFlash2 draft without it",
        )
    if dfc.get("causal"):
        raise CheckpointError(
            f"DFlash2 draft is causal within the block (dflash_config.causal), which dflash does not compute: {where}",
            hint="use a draft trained with a bidirectional block (causal: false)",
        )
    required = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    missing = [k for k in required if not _pos(dfc, k)]
    if missing:
        raise CheckpointError(
            f"DFlash2 draft's dflash_config lacks a positive {', '.join(missing)}: {where}",
            hint="the checkpoint's config.json is incomplete; download it again",
        )
    hidden, vocab = int(cfg.get("hidden_size") or 0), int(cfg.get("vocab_size") or 0)
    spec = Dflash2Spec(
        taps=int(dfc["conv_kernel_size"]),
        group_size=int(dfc["conv_group_size"]),
        rank=int(dfc["selector_rank"]),
        top_k=int(dfc["selector_top_k"]),
        output_multiplier=float(dfc.get("output_multiplier") or 1.0),
        softcap=float(dfc["final_logit_softcapping"]) if dfc.get("final_logit_softcapping") else None,
    )
    if hidden and hidden % spec.group_size:
        raise CheckpointError(
            f"DFlash2 conv_group_size {spec.group_size} does not divide hidden_size {hidden}: {where}",
            hint="the checkpoint's config.json is inconsistent",
        )
    if vocab and spec.top_k > vocab:
        raise CheckpointError(
            f"DFlash2 selector_top_k {spec.top_k} exceeds the vocabulary ({vocab}): {where}",
            hint="the checkpoint's config.json is inconsistent",
        )
    if spec.output_multiplier <= 0 or (spec.softcap is not None and spec.softcap <= 0):
        raise CheckpointError(
            f"DFlash2 output_multiplier and final_logit_softcapping must be positive: {where}",
            hint="the checkpoint's config.json is inconsistent",
        )
    return spec


def _pos(d: dict, key: str) -> bool:
    v = d.get(key)
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def weight_shapes(spec: Dflash2Spec, hidden: int, vocab: int, layers: int, block: int) -> dict[str, tuple[int, ...]]:
    """The tensors a DFlash2 draft holds beyond a DFlash draft's."""
    if spec.taps > block:
        raise CheckpointError(
            f"DFlash2 conv_kernel_size {spec.taps} exceeds the block size {block}",
            hint="set dflash.block_size to the draft's own block size",
        )
    kernel = (2 * spec.taps * (hidden // spec.group_size), hidden)
    shapes: dict[str, tuple[int, ...]] = {
        "candidate_selector.predecessor_codebook": (vocab, spec.rank),
        "candidate_selector.successor_codebook": (vocab, spec.rank),
        "candidate_selector.hidden_projection.weight": (spec.rank, hidden),
    }
    for n in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{n}.{conv}.base_kernel"] = (2, spec.taps, hidden)
            shapes[f"layers.{n}.{conv}.kernel_projection.weight"] = kernel
    return shapes


def draft_window(cfg: dict[str, Any]) -> int | None:
    """The sliding window of a draft whose layers have one (DFlash2 drafts: every layer), else None."""
    kinds = cfg.get("layer_types")
    sliding = any(k == "sliding_attention" for k in kinds) if isinstance(kinds, list) else cfg.get("use_sliding_window")
    window = cfg.get("sliding_window")
    return int(window) if sliding and isinstance(window, int) and window > 0 else None


def check_window(cfg: dict[str, Any], ctx_len: int) -> None:
    """Our draft attends to its whole context: a window that could bind (one shorter than ctx_len) would propose
    other tokens than the draft was trained to, so it is refused rather than ignored."""
    window = draft_window(cfg)
    if window is not None and window < ctx_len:
        raise RecipeError(
            f"the draft attends to a sliding window of {window} positions, shorter than export.ctx_len {ctx_len}: "
            "dflash computes a draft's window only where it never binds",
            hint=f"set export.ctx_len to {window} or less",
        )
