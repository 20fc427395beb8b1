"""Resolve and validate a target/draft pair: the DFlash facts every later stage relies on.

Recipe values override the draft config, which overrides the family defaults. Every mismatch a
user can cause is a one-line CheckpointError with a hint, raised before any weight is written.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from dflash_cli.errors import CheckpointError
from dflash_cli.families import Family, family_for

PAIR_FILE = "pair.json"


@dataclass(frozen=True)
class PairInfo:
    """The resolved pair. Sequences are tuples (immutable); JSON holds them as lists."""

    family: str
    model_type: str
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    num_draft_layers: int
    hidden_size: int
    vocab_size: int  # rows of the target's embedding table (may exceed the tokenizer's size)
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    fc_scale: float = 1.0  # set by inject: the target's dflash.fc.weight = draft fc.weight / fc_scale

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PairInfo:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        try:
            info = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise CheckpointError(f"{PAIR_FILE} is incomplete: {exc}", hint="rebuild the convert stage") from None
        return replace(info, target_layer_ids=tuple(info.target_layer_ids), eos_token_ids=tuple(info.eos_token_ids))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """REFERENCE 2: evenly spaced from layer 1 to layer N-3; one draft layer taps N // 2."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    # round() (half-to-even) as the reference implementation does, so defaults match published drafts.
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def resolve_pair(
    target_cfg: dict[str, Any],
    draft_cfg: dict[str, Any],
    recipe: Any,
    target_vocab_size: int,
    *,
    generation_cfg: dict[str, Any] | None = None,
) -> PairInfo:
    """Merge recipe overrides with the draft config and validate the pair."""
    # Checked in this order: a pair wrong in several ways reports the first of them.
    model_type = target_cfg.get("model_type")
    family = _recipe_family(model_type, recipe.family)
    dflash_cfg = _dflash_config(draft_cfg)
    overrides = recipe.dflash
    block_size = _block_size(overrides, draft_cfg, dflash_cfg)
    hidden = _hidden_size(target_cfg, draft_cfg)
    num_target_layers, num_draft_layers = _layer_counts(target_cfg, draft_cfg, dflash_cfg)
    layer_ids = _target_layer_ids(overrides, draft_cfg, dflash_cfg, num_target_layers, num_draft_layers)
    mask = _mask_token_id(overrides, draft_cfg, dflash_cfg, family.default_mask_token_id, target_vocab_size)
    return PairInfo(
        family=family.model_type,
        model_type=model_type,
        block_size=block_size,
        target_layer_ids=tuple(layer_ids),
        mask_token_id=mask,
        num_target_layers=num_target_layers,
        num_draft_layers=num_draft_layers,
        hidden_size=hidden,
        vocab_size=target_vocab_size,
        eos_token_ids=tuple(_eos_ids(target_cfg, generation_cfg)),
        tie_word_embeddings=bool(target_cfg.get("tie_word_embeddings", False)),
    )


def _recipe_family(model_type: Any, recipe_family: str) -> Family:
    """The target's family, which the recipe must name."""
    family = family_for(model_type)
    if recipe_family != family.model_type:
        raise CheckpointError(
            f"recipe family {recipe_family!r} does not match the target's model_type {model_type!r}",
            hint=f"set family: {family.model_type} in the recipe, or point target.path at a {recipe_family} checkpoint",
        )
    return family


def _dflash_config(draft_cfg: dict[str, Any]) -> dict[str, Any]:
    dflash_cfg = draft_cfg.get("dflash_config")
    if not isinstance(dflash_cfg, dict):
        raise CheckpointError(
            "draft config has no dflash_config: not a DFlash draft checkpoint",
            hint="point draft.path at a DFlash draft (config.json with block_size and dflash_config)",
        )
    return dflash_cfg


def _block_size(overrides: Any, draft_cfg: dict[str, Any], dflash_cfg: dict[str, Any]) -> int:
    # newer checkpoints keep block_size (and num_target_layers) in dflash_config; refuse_unread checks that the
    # places a field may sit in agree
    block_size = _first(
        getattr(overrides, "block_size", None), draft_cfg.get("block_size"), dflash_cfg.get("block_size")
    )
    if block_size is None:
        raise CheckpointError("draft config has no block_size", hint="set dflash.block_size in the recipe")
    if not _is_int(block_size) or block_size < 2:
        raise CheckpointError(f"block_size must be an integer >= 2, got {block_size!r}", hint="fix dflash.block_size")
    return block_size


def _hidden_size(target_cfg: dict[str, Any], draft_cfg: dict[str, Any]) -> int:
    hidden = _required_int(target_cfg, "hidden_size", "target")
    draft_hidden = _required_int(draft_cfg, "hidden_size", "draft")
    if hidden != draft_hidden:
        raise CheckpointError(
            f"hidden sizes differ: target {hidden}, draft {draft_hidden}",
            hint="use the DFlash draft trained for this target model",
        )
    return hidden


def _layer_counts(target_cfg: dict[str, Any], draft_cfg: dict[str, Any], dflash_cfg: dict[str, Any]) -> tuple[int, int]:
    """(target layers, draft layers), the draft trained for a target of that depth where it says so."""
    num_target_layers = _required_int(target_cfg, "num_hidden_layers", "target")
    num_draft_layers = _required_int(draft_cfg, "num_hidden_layers", "draft")
    draft_expects = _first(draft_cfg.get("num_target_layers"), dflash_cfg.get("num_target_layers"))
    if draft_expects is not None and draft_expects != num_target_layers:
        raise CheckpointError(
            f"draft was trained for a {draft_expects}-layer target, this target has {num_target_layers} layers",
            hint="use the DFlash draft trained for this target model",
        )
    return num_target_layers, num_draft_layers


def _target_layer_ids(
    overrides: Any, draft_cfg: dict[str, Any], dflash_cfg: dict[str, Any], num_target_layers: int, num_draft_layers: int
) -> list[int]:
    # some configs name the taps and the mask token at the top level (as SGLang reads them): taken there too
    layer_ids = _first(
        getattr(overrides, "target_layer_ids", None),
        dflash_cfg.get("target_layer_ids"),
        draft_cfg.get("target_layer_ids"),
    )
    if layer_ids is None:
        layer_ids = default_target_layer_ids(num_target_layers, num_draft_layers)
    layer_ids = list(layer_ids)
    if not layer_ids or not all(_is_int(i) and 0 <= i < num_target_layers for i in layer_ids):
        raise CheckpointError(
            f"target_layer_ids {layer_ids} must be non-empty and within [0, {num_target_layers - 1}]",
            hint="fix dflash.target_layer_ids in the recipe (or the draft's dflash_config)",
        )
    return layer_ids


def _mask_token_id(
    overrides: Any, draft_cfg: dict[str, Any], dflash_cfg: dict[str, Any], default: int | None, vocab_size: int
) -> int:
    mask = _first(
        getattr(overrides, "mask_token_id", None),
        dflash_cfg.get("mask_token_id"),
        draft_cfg.get("mask_token_id"),
        default,
    )
    if not _is_int(mask) or not 0 <= mask < vocab_size:
        raise CheckpointError(
            f"mask_token_id {mask!r} is outside the target vocabulary (size {vocab_size})",
            hint="set dflash.mask_token_id to a token id that exists in the target's embedding table",
        )
    return mask


def draft_weight_shapes(draft_cfg: dict[str, Any], pair: PairInfo) -> dict[str, tuple[int, ...]]:
    """Every tensor a z-lab DFlash draft checkpoint holds (no `model.` prefix), with its shape."""
    hidden = pair.hidden_size
    heads = _required_int(draft_cfg, "num_attention_heads", "draft")
    kv_heads = draft_cfg.get("num_key_value_heads") or heads
    head_dim = draft_cfg.get("head_dim") or hidden // heads
    inter = _required_int(draft_cfg, "intermediate_size", "draft")
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, len(pair.target_layer_ids) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for n in range(pair.num_draft_layers):
        p = f"layers.{n}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    from dflash_cli.modeling.dflash2_config import spec_of, weight_shapes

    spec = spec_of(draft_cfg)
    if spec is not None:
        shapes |= weight_shapes(spec, hidden, pair.vocab_size, pair.num_draft_layers, pair.block_size)
    return shapes


def _eos_ids(target_cfg: dict[str, Any], generation_cfg: dict[str, Any] | None) -> list[int]:
    # generation_config.json is what chat models actually stop on (e.g. <|im_end|>), so it comes first.
    ids: list[int] = []
    for source in (generation_cfg or {}, target_cfg):
        value = source.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if _is_int(i) and i not in ids:
                ids.append(i)
    return ids


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _required_int(cfg: dict[str, Any], key: str, role: str) -> int:
    value = cfg.get(key)
    if not _is_int(value) or value <= 0:
        raise CheckpointError(f"{role} config has no valid {key} (got {value!r})", hint=f"check the {role} config.json")
    return value
