"""What a DFlash2 draft's config.json says beyond a DFlash draft's, the tensors it adds, and the fields of any
draft's config that change what it computes but that dflash does not compute, refused by name (no torch: convert
reads this). The modules are in dflash2.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_cli.errors import CheckpointError, RecipeError

ARCHITECTURE = "DFlash2DraftModel"
# dflash_config fields a DFlash2 draft may carry (spec_of computes them)
_FIELDS = {
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
}
# dflash_config fields every draft may carry: pairing/pair.py reads them (mask_token names mask_token_id's token)
_DFLASH_FIELDS = {"mask_token_id", "target_layer_ids", "block_size", "num_target_layers", "mask_token"}
# Fields that change what a draft computes only away from these values (the upstream defaults), in dflash_config
# or, for a speculators draft, at its top level; at any other value they are refused, as is every dflash_config
# field in none of these tables. use_target_norm's upstream meaning could not be established, so it is refused
# rather than guessed at. The DFlash2 fields are computed on a DFlash2 draft only.
INERT = {
    "causal": (False,),
    "use_target_norm": (False,),
    "sample_from_anchor": (False,),
    "shift_label": (False,),
    "projector_type": ("dflash",),
    "attention_sink_bias": (False,),
    "attention_value_scale": (),
    "input_embedding_scale": (1.0,),
    "output_multiplier": (1.0,),
    "final_logit_softcapping": (0,),
    "conv_kernel_size": (0,),
    "conv_group_size": (0,),
    "selector_rank": (0,),
    "selector_top_k": (0,),
}
# Fields of the draft's layers (the config's top level) that change what they compute away from these values
LAYER_INERT = {
    "hidden_act": ("silu", "swish"),  # the MLP is SwiGLU
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "is_causal": (False,),  # the block attends to itself both ways
    "use_target_norm": (False,),
    "partial_rotary_factor": (1.0,),  # draft layers rotate the whole head
    "is_neox_style": (True,),  # rotate_half RoPE, as Qwen3's
    "rope_is_neox_style": (True,),
    "quantization_config": (),  # weights are read as plain tensors
}


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
    refuse_unread_fields(dfc, "DFlash2 draft's dflash_config", where, dflash2=True)
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


def unread_fields(fields: dict[str, Any], *, dflash2: bool) -> list[str]:
    """`name value` of each field in `fields` (a dflash_config) that would change what the draft computes and
    that dflash does not compute: unknown ones, and those of INERT away from their inert values."""
    computed = _DFLASH_FIELDS | (_FIELDS if dflash2 else set())
    return [
        f"{k} {v!r}"
        for k, v in sorted(fields.items())
        if k not in computed and (k not in INERT or (v is not None and v not in INERT[k]))
    ]


def refuse_unread_fields(fields: dict[str, Any], what: str, where: str, *, dflash2: bool) -> None:
    unread = unread_fields(fields, dflash2=dflash2)
    if unread:
        raise CheckpointError(
            f"{what} has {', '.join(unread)}, which dflash does not compute: {where}", hint=_hint(unread[0])
        )


def refuse_unread(cfg: dict[str, Any], where: str) -> None:
    """Refuse a draft config (z-lab form) carrying a field that would change what the draft computes and that
    dflash does not compute, naming it: at convert, before any weight is read. Run as if the field were absent,
    the draft would propose other tokens than it was trained to."""
    dfc = cfg.get("dflash_config") or {}
    refuse_unread_fields(dfc, f"{_kind(cfg)} draft's dflash_config", where, dflash2=is_dflash2(cfg))
    if dfc.get("mask_token") is not None and dfc.get("mask_token_id", cfg.get("mask_token_id")) is None:
        raise CheckpointError(
            f"draft's dflash_config names its mask token {dfc['mask_token']!r} but not its id: {where}",
            hint="add that token's id to the draft's dflash_config as mask_token_id",
        )
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    layer = {k: v for k, v in {**cfg, **rope}.items() if k in LAYER_INERT and v is not None}
    changed = [f"{k} {v!r}" for k, v in sorted(layer.items()) if v not in LAYER_INERT[k]]
    if changed:
        raise CheckpointError(
            f"{_kind(cfg)} draft config has {', '.join(changed)}, which dflash does not compute: {where}",
            hint=_hint(changed[0]),
        )
    # pairing/pair.py reads these from dflash_config or the top level: where both say them, they must agree
    for key in ("block_size", "num_target_layers", "target_layer_ids", "mask_token_id"):
        if None not in (cfg.get(key), dfc.get(key)) and cfg[key] != dfc[key]:
            raise CheckpointError(
                f"draft config says {key} {cfg[key]} at its top level and {dfc[key]} in dflash_config: {where}",
                hint="the checkpoint's config.json is inconsistent",
            )


def _kind(cfg: dict[str, Any]) -> str:
    return "DFlash2" if is_dflash2(cfg) else "DFlash"


def _hint(first: str) -> str:
    if first.startswith("use_target_norm"):
        return "its upstream meaning is not established, so dflash refuses it rather than guess; use a draft without it"
    if first.startswith("causal"):
        return "use a draft trained with a bidirectional block (causal: false)"
    return "this draft variant is not supported yet; use a DFlash or DFlash2 draft without it"


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
