"""Qwen3.5 / Qwen3.6 dense: Gated DeltaNet layers, every fourth layer gated full attention (text path)."""

from dflash_cli.families.family import Family

FAMILY = Family(
    "qwen3_5",
    qk_norm=True,
    default_mask_token_id=248070,
    model_types=("qwen3_5", "qwen3_5_text"),
    hybrid=True,
    vision=True,  # Qwen3_5ForConditionalGeneration's tower (on ONNX Runtime; QAIC builds the text path)
    mrope_model="transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5Model",
    tool_call_format="qwen3_xml",
)
