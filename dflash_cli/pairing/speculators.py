"""DFlash drafts saved by vLLM's `speculators` library, read as the z-lab layout the later stages build from.

A speculators config says `speculators_model_type: dflash` (or `dflash2`: a DFlash2 draft, its convolution
and selector fields at the top level) and keeps the draft layers' own config under
`transformer_layer_config`; the pair fields sit at the top level: `block_size`, `mask_token_id`,
`draft_vocab_size` and `aux_hidden_state_layer_ids`, which index the target's hidden states as Hugging Face
counts them (0 is the embedding output, i the output of decoder layer i - 1), where z-lab's target_layer_ids
count decoder layers. The layer weights have z-lab's names; the checkpoint may also hold the verifier's
final norm (`verifier_norm.weight`), and a reduced vocabulary's own head with its maps (`lm_head.weight`,
`d2t`, `t2d`). Whatever changes what the draft computes beyond that is refused by name.
"""

from __future__ import annotations

from typing import Any

from dflash_cli.errors import CheckpointError
from dflash_cli.families import DRAFT_MODEL_TYPE
from dflash_cli.modeling.dflash2_config import INERT, LAYER_INERT, refuse_unread_fields

# tensors a speculators checkpoint may carry that a full-vocabulary draft does not use (the verifier's own)
IGNORED_TENSORS = ("verifier_norm.weight", "verifier_lm_head.weight", "embed_tokens.weight", "lm_head.weight")
_LAYER_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "vocab_size",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "hidden_act",
    "attention_bias",
    "max_window_layers",
    *LAYER_INERT,  # refused by convert's refuse_unread unless inert
)


def is_speculators(cfg: dict[str, Any]) -> bool:
    return "speculators_model_type" in cfg


def as_zlab(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """The z-lab form of a speculators DFlash config (other configs unchanged)."""
    if not is_speculators(cfg):
        return cfg
    kind = cfg.get("speculators_model_type")
    if kind not in ("dflash", "dflash2"):
        raise CheckpointError(
            f"draft is a speculators {kind!r} model, not a DFlash draft: {where}",
            hint="point draft.path at a DFlash draft (z-lab's, or speculators' with speculators_model_type dflash)",
        )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"speculators config has no transformer_layer_config: {where}", hint=_DOWNLOAD)
    _refuse_unsupported(cfg, layer, where)
    aux = cfg.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and i >= 1 for i in aux):
        raise CheckpointError(
            f"speculators aux_hidden_state_layer_ids {aux!r} must list hidden-state indices >= 1 "
            f"(0 is the embedding output, which dflash does not tap): {where}",
            hint="set dflash.target_layer_ids in the recipe (decoder layer indices, counted from 0)",
        )
    out = {k: layer[k] for k in _LAYER_FIELDS if k in layer}
    if cfg.get("quantization_config") is not None:
        out["quantization_config"] = cfg["quantization_config"]
    dflash_config = {"target_layer_ids": [i - 1 for i in aux]}
    if cfg.get("mask_token_id") is not None:
        dflash_config["mask_token_id"] = cfg["mask_token_id"]
    if kind == "dflash2":  # its convolution and selector fields, at the defaults speculators' config class has
        dflash_config |= {k: cfg.get(k, default) for k, default in _DFLASH2_DEFAULTS.items()}
        # the logit transforms a DFlash2 draft's selector reads, where a config carries them
        dflash_config |= {k: cfg[k] for k in ("output_multiplier", "final_logit_softcapping") if k in cfg}
    out |= {
        "architectures": ["DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"],
        "model_type": DRAFT_MODEL_TYPE,
        "block_size": cfg.get("block_size"),
        "dflash_config": dflash_config,
        "speculators_model_type": kind,  # kept: says where the config came from
    }
    return out


_DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


_DOWNLOAD = "the checkpoint's config.json is incomplete; download it again"


def _refuse_unsupported(cfg: dict[str, Any], layer: dict[str, Any], where: str) -> None:
    def refuse(what: str, hint: str) -> None:
        raise CheckpointError(f"speculators DFlash draft has {what}, which dflash does not compute: {where}", hint=hint)

    other = "use a z-lab format DFlash draft, or a speculators DFlash draft without it"
    if cfg.get("projector_type", "dflash") != "dflash":
        refuse(f"projector_type {cfg['projector_type']!r}", other)
    if cfg.get("sample_from_anchor"):
        refuse("sample_from_anchor: true (a proposal at the anchor's own position)", other)
    if cfg.get("shift_label"):
        refuse("shift_label: true (predictions shifted by one position)", other)
    if layer.get("model_type", DRAFT_MODEL_TYPE) != DRAFT_MODEL_TYPE:  # our draft layers are Qwen3's (q/k norms)
        refuse(f"{layer['model_type']!r} layers (transformer_layer_config.model_type)", other)
    hidden = layer.get("hidden_size")
    if cfg.get("target_hidden_size") not in (None, hidden):
        refuse(f"target_hidden_size {cfg['target_hidden_size']} (the draft's hidden size is {hidden})", other)
    vocab, draft_vocab = layer.get("vocab_size"), cfg.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != vocab:
        refuse(
            f"a reduced draft vocabulary (draft_vocab_size {draft_vocab} of the target's {vocab})",
            "use a draft trained over the target's whole vocabulary",
        )
    # a DFlash variant's knobs at the top level (DFlash2's selector and convolution ones by prefix, e.g.
    # selector_temperature): computed (dflash2: the z-lab form's dflash_config carries them) or refused here; the
    # rest of the top level is the config classes' own metadata (versions, verifier, proposal methods)
    variant = {k: v for k, v in cfg.items() if k in INERT or k.startswith(("selector_", "conv_"))}
    kind = cfg.get("speculators_model_type")
    label = "speculators DFlash2 draft" if kind == "dflash2" else "speculators DFlash draft"
    refuse_unread_fields(variant, label, where, dflash2=kind == "dflash2")
    kinds = layer.get("layer_types") or []
    # speculators' DFlash2 drafts are bidirectional in sliding layers unless they say otherwise; DFlash ones causal
    non_causal = cfg.get("sliding_window_non_causal", kind == "dflash2")
    if "sliding_attention" in kinds and not non_causal:
        refuse(
            "sliding-window layers that are causal within the block (sliding_window_non_causal: false)",
            "use a draft whose blocks are bidirectional in every layer",
        )
