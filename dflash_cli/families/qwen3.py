"""Qwen3 (dense): q and k normalised per head; its chat template takes `enable_thinking`."""

from dflash_cli.families.family import Family

FAMILY = Family(
    "qwen3",
    qk_norm=True,
    default_mask_token_id=151669,
    thinking_switch=True,
    qaic_slot_cache=True,
    tool_call_format="hermes",
)
