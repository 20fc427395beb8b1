"""Qwen3-VL: a Qwen3 language model (M-RoPE, which equals RoPE on text positions) under a vision tower."""

from dflash_cli.families.family import Family

FAMILY = Family(
    "qwen3_vl",
    qk_norm=True,
    default_mask_token_id=151669,
    model_types=("qwen3_vl", "qwen3_vl_text"),
    vision=True,
    mrope_model="transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLModel",
    qaic_vision=True,
    tool_call_format="hermes",
)
