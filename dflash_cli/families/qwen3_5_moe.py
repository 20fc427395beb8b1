"""Qwen3.5 / Qwen3.6 mixture of experts (35B-A3B): Qwen3.5's layers, each MLP routed experts plus a shared one."""

from dflash_cli.families.family import Family

FAMILY = Family(
    "qwen3_5_moe",
    qk_norm=True,
    default_mask_token_id=248070,
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    hybrid=True,
    moe=True,
    vision=True,
    mrope_model="transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5Model",  # Qwen3.5's rope-index rule
    tool_call_format="qwen3_xml",
)
