"""The families, keyed by Hugging Face `model_type`, and their lookup (no name-substring dispatch)."""

from __future__ import annotations

from typing import Any

from dflash_cli.errors import CheckpointError, DFlashError
from dflash_cli.families import (
    gemma4,
    gpt_oss,
    llama,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
from dflash_cli.families.family import Family

# In this order a recipe's `family` error lists them (recipe/schema.py).
FAMILIES: dict[str, Family] = {
    m.FAMILY.model_type: m.FAMILY
    for m in (qwen3, llama, gemma4, qwen3_vl, qwen3_5, qwen3_moe, qwen3_5_moe, qwen3_next, gpt_oss)
}
FAMILY_NAMES = tuple(FAMILIES)

# A DFlash draft's layers are Qwen3's (q_norm and k_norm) whatever its target: the z-lab config convert writes
# for a speculators draft names this type, and a speculators layer config naming another is refused.
DRAFT_MODEL_TYPE = "qwen3"


# Every trait off: what an unknown name or model_type reads, as a by-name test of it would have.
_NONE = Family("", qk_norm=False, default_mask_token_id=None)


def _find(model_type: Any) -> Family | None:
    """The family of a checkpoint's `model_type` (its own, or its multimodal / text-only layout's); None if unknown."""
    if not isinstance(model_type, str):
        return None
    return FAMILIES.get(model_type) or next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def family_for(model_type: str | None) -> Family:
    """The family of a checkpoint's `model_type`; an unknown one is refused."""
    fam = _find(model_type)
    if fam is None:
        raise CheckpointError(
            f"unsupported target model_type {model_type!r}",
            hint=f"supported families: {', '.join(sorted(FAMILIES))}",
        )
    return fam


def traits_of(model_type: Any) -> Family:
    """The family of a checkpoint's `model_type`, every trait off where unknown (convert refuses it later)."""
    return _find(model_type) or _NONE


def family_named(name: str) -> Family:
    """The family a recipe names. A Recipe has validated the name; an unknown one (a stand-in recipe) reads every
    trait off."""
    return FAMILIES.get(name, _NONE)


def require_qaic_support(family: str) -> None:
    """Refuse, before anything is built, a family the QAIC backend cannot take."""
    fam = FAMILIES.get(family)
    if fam is not None and fam.qaic_refusal:
        raise DFlashError(fam.qaic_refusal, hint="build with `--set compile.backend=ort`")
