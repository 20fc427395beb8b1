"""Per-family facts, keyed by the Hugging Face `model_type` (no name-substring dispatch)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_cli.errors import CheckpointError, DFlashError


@dataclass(frozen=True)
class Family:
    model_type: str
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE; Llama does not
    default_mask_token_id: int | None  # the published drafts' mask id, when the draft config lacks one
    # Hugging Face model_types of this family's checkpoints (the multimodal layout and the text-only one)
    model_types: tuple[str, ...] = ()
    # Linear-attention layers between full-attention ones (modeling/hybrid_target.py), not StaticCacheTarget
    hybrid: bool = False
    # Sparse mixture-of-experts MLPs (modeling/moe.py) in the layers modeling.moe.sparse_layers names
    moe: bool = False
    # Sliding-window attention layers (config `layer_types`), computed with their window
    sliding: bool = False
    # Images in, where the checkpoint has a vision tower: its graph and a language model taking its features
    # (modeling/vl_target.py, gemma4_target.py, hybrid_target.py); a QAIC build keeps the text path only
    vision: bool = False


FAMILIES: dict[str, Family] = {
    "qwen3": Family("qwen3", qk_norm=True, default_mask_token_id=151669),
    "llama": Family("llama", qk_norm=False, default_mask_token_id=128002),
    # Qwen3-MoE (Qwen3-Coder-30B-A3B, Qwen3-30B-A3B): Qwen3 attention, routed experts without a shared one.
    "qwen3_moe": Family("qwen3_moe", qk_norm=True, default_mask_token_id=151669, moe=True),
    # gpt-oss (20b, 120b): attention sinks, every other layer a 128-token window, biased projections, YaRN;
    # every MLP routed experts. The published drafts' configs name their mask token.
    "gpt_oss": Family("gpt_oss", qk_norm=False, default_mask_token_id=None, moe=True, sliding=True),
    # Qwen3-VL: a Qwen3 language model (M-RoPE, which equals RoPE on text positions) under a vision tower.
    "qwen3_vl": Family(
        "qwen3_vl", qk_norm=True, default_mask_token_id=151669, model_types=("qwen3_vl", "qwen3_vl_text"), vision=True
    ),
    # Gemma 4 (31B, 12B): sliding-window and global layers of different shapes (modeling/gemma4_target.py).
    "gemma4": Family(
        "gemma4",
        qk_norm=True,
        default_mask_token_id=None,
        model_types=("gemma4", "gemma4_text"),
        sliding=True,
        vision=True,  # Gemma4ForConditionalGeneration: its tower and embedder (a text-only checkpoint has none)
    ),
    # Qwen3.5 / Qwen3.6 dense: Gated DeltaNet layers, every fourth layer gated full attention (text path).
    "qwen3_5": Family(
        "qwen3_5",
        qk_norm=True,
        default_mask_token_id=248070,
        model_types=("qwen3_5", "qwen3_5_text"),
        hybrid=True,
        vision=True,  # Qwen3_5ForConditionalGeneration's tower (on ONNX Runtime; QAIC builds the text path)
    ),
    # Qwen3.5 / Qwen3.6 mixture of experts (35B-A3B): the same layers, each MLP routed experts plus a shared one.
    "qwen3_5_moe": Family(
        "qwen3_5_moe",
        qk_norm=True,
        default_mask_token_id=248070,
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        hybrid=True,
        moe=True,
        vision=True,
    ),
}


def family_for(model_type: str | None) -> Family:
    fam = FAMILIES.get(model_type or "") or next(
        (f for f in FAMILIES.values() if model_type and model_type in f.model_types), None
    )
    if fam is None:
        raise CheckpointError(
            f"unsupported target model_type {model_type!r}",
            hint=f"supported families: {', '.join(sorted(FAMILIES))}",
        )
    return fam


def require_qaic_support(family: str) -> None:
    """Refuse, before anything is built, a family the QAIC backend cannot take."""
    if family == "gemma4":
        raise DFlashError(
            "compile.backend=qaic does not take Gemma 4 targets yet: their global layers' KV cache has another"
            " head width and head count than the sliding layers', and the bundle's specializations assume one",
            hint="build with `--set compile.backend=ort`",
        )
